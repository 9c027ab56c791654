"""The static fallback: a fixed message in the shape of the endpoint the client called.

It costs nothing and cannot fail, so it is the last fallback. ``finish_reason`` is ``"stop"`` and usage is
zero: no model ran.
"""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from engine.protocol import SSE_DONE, sse_data


def static_response(
    request: web.Request, path: str, message: str, stream: bool, headers: dict[str, str]
) -> web.StreamResponse | web.Response:
    chat = path.endswith("/chat/completions")
    created = int(time.time())
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    if not stream:
        choice = ({"index": 0, "message": {"role": "assistant", "content": message}, "finish_reason": "stop"}
                  if chat else {"index": 0, "text": message, "logprobs": None, "finish_reason": "stop"})
        body = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": "static", "choices": [choice],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
        return web.json_response(body, headers=headers)
    obj = "chat.completion.chunk" if chat else "text_completion"
    delta = ({"index": 0, "delta": {"role": "assistant", "content": message}, "finish_reason": "stop"}
             if chat else {"index": 0, "text": message, "logprobs": None, "finish_reason": "stop"})
    event = {"id": ident, "object": obj, "created": created, "model": "static", "choices": [delta]}
    body = sse_data(json.dumps(event)) + SSE_DONE
    return web.Response(body=body, headers={**headers, "Content-Type": "text/event-stream",
                                             "Cache-Control": "no-cache"})
