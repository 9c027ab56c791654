"""Server-sent events: one ``data:`` line per event, comments as heartbeats, and the OpenAI stream ending.

A stream that completes ends with ``data: [DONE]``; one that fails after it started ends with an ``error``
event carrying the OpenAI error body, and no ``[DONE]``, so a client can tell the two apart.
"""

from __future__ import annotations

from aiohttp import web

from engine.server.errors import ApiError

DONE = b"data: [DONE]\n\n"


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})  # tell proxies not to buffer events
    await response.prepare(request)
    return response


async def send_data(response: web.StreamResponse, payload: str) -> None:
    await response.write(b"data: " + payload.encode() + b"\n\n")


async def send_comment(response: web.StreamResponse, text: str) -> None:
    await response.write(b": " + text.encode() + b"\n\n")


async def send_error(response: web.StreamResponse, error: ApiError) -> None:
    await response.write(b"event: error\ndata: " + error.body().encode() + b"\n\n")
