"""The guard's own answers in the OpenAI error shape, as JSON responses and as the SSE event that ends a
failed stream; the body, its ``type`` by status and the event's framing are the engine's (engine/protocol.py),
so that a client reads the guard's errors and the engine's relayed ones alike."""

from __future__ import annotations

from aiohttp import web

from engine.protocol import ErrorResponse, sse_error


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   retry_after: int | None = None, headers: dict[str, str] | None = None) -> web.Response:
    all_headers = dict(headers or {})
    if retry_after is not None:
        all_headers["Retry-After"] = str(retry_after)
    body = ErrorResponse.of(status, message, param=param, code=code).model_dump_json()
    return web.Response(text=body, status=status, content_type="application/json", headers=all_headers)


def sse_error_event(status: int, message: str, code: str | None = None) -> bytes:
    """The event that ends a stream which failed after it started (no ``[DONE]`` follows it)."""
    return sse_error(ErrorResponse.of(status, message, code=code))
