"""Server-sent events, framed one way by the engine and the guard.

Each payload is one line (JSON is), so one ``data:`` line carries it. A stream that completes ends with
``SSE_DONE``; one that fails after it started ends with ``sse_error`` and no ``SSE_DONE``, so that a client
can tell the two apart.
"""

from __future__ import annotations

from engine.protocol.errors import ErrorResponse

SSE_DONE = b"data: [DONE]\n\n"


def sse_data(payload: str) -> bytes:
    return b"data: " + payload.encode() + b"\n\n"


def sse_event(name: str, payload: str) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + payload.encode() + b"\n\n"


def sse_comment(text: str) -> bytes:
    """A line every client skips: a heartbeat that keeps an idle stream (and the proxies on its way) open."""
    return b": " + text.encode() + b"\n\n"


def sse_error(error: ErrorResponse) -> bytes:
    return sse_event("error", error.model_dump_json())
