"""Server-sent events onto an aiohttp response: data events, heartbeat comments, the error event and the
OpenAI stream ending, framed by engine/protocol/sse.py (the guard frames its events with the same functions).

A stream that completes ends with ``data: [DONE]``; one that fails after it started ends with an ``error``
event carrying the OpenAI error body, and no ``[DONE]``, so a client can tell the two apart.
"""

from __future__ import annotations

from aiohttp import web

from engine.protocol import SSE_DONE, sse_comment, sse_data, sse_error
from engine.server.errors import ApiError


async def open_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})  # tell proxies not to buffer events
    await response.prepare(request)
    return response


async def send_data(response: web.StreamResponse, payload: str) -> None:
    await response.write(sse_data(payload))


async def send_comment(response: web.StreamResponse, text: str) -> None:
    await response.write(sse_comment(text))


async def send_error(response: web.StreamResponse, error: ApiError) -> None:
    await response.write(sse_error(error.body))


async def send_done(response: web.StreamResponse) -> None:
    await response.write(SSE_DONE)
