"""The static fallback: a fixed message in the shape of the endpoint the client called.

It costs nothing and cannot fail, so it is the last fallback. ``finish_reason`` is ``"stop"`` and usage is
zero: no model ran. It answers as many choices as the request asks, numbered as an engine numbers them (a
``/v1/completions`` batch: choice ``i`` of prompt ``p`` is ``p * n + i``), so that a client that pairs
choices with its prompts (LangChain's ``OpenAI.batch``) finds an answer for each. A Responses request gets
a completed response (guard/http/responses.py).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web

from engine.protocol import SSE_DONE, CompletionRequest, sse_data
from guard.http.responses import static_answer
from guard.http.validate import RESPONSES, ParsedRequest


def static_response(parsed: ParsedRequest, message: str, headers: dict[str, str]) -> web.Response:
    if parsed.path == RESPONSES:
        return static_answer(parsed, message, headers)
    chat = parsed.path.endswith("/chat/completions")
    created = int(time.time())
    ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    request = parsed.model
    prompts = len(request.prompts) if isinstance(request, CompletionRequest) else 1
    indices = range(prompts * request.n)
    if not parsed.stream:
        choices = [_chat_choice(i, message, "message") if chat else _text_choice(i, message) for i in indices]
        body = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": "static", "choices": choices,
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}
        return web.json_response(body, headers=headers)
    obj = "chat.completion.chunk" if chat else "text_completion"
    deltas = [_chat_choice(i, message, "delta") if chat else _text_choice(i, message) for i in indices]
    event = {"id": ident, "object": obj, "created": created, "model": "static", "choices": deltas}
    body = sse_data(json.dumps(event)) + SSE_DONE
    return web.Response(body=body, headers={**headers, "Content-Type": "text/event-stream",
                                             "Cache-Control": "no-cache"})


def _chat_choice(index: int, message: str, key: str) -> dict[str, Any]:
    return {"index": index, key: {"role": "assistant", "content": message}, "finish_reason": "stop"}


def _text_choice(index: int, message: str) -> dict[str, Any]:
    return {"index": index, "text": message, "logprobs": None, "finish_reason": "stop"}
