"""Errors in the OpenAI shape, as JSON responses and as the SSE event that ends a failed stream."""

from __future__ import annotations

import json

from aiohttp import web

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 502: "api_error", 503: "overloaded_error",
               504: "timeout_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "api_error"), "param": param,
                      "code": code}}


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   retry_after: int | None = None, headers: dict[str, str] | None = None) -> web.Response:
    all_headers = dict(headers or {})
    if retry_after is not None:
        all_headers["Retry-After"] = str(retry_after)
    return web.json_response(error_body(status, message, param, code), status=status, headers=all_headers)


def sse_error_event(status: int, message: str, code: str | None = None) -> bytes:
    """The event that ends a stream which failed after it started (no ``[DONE]`` follows it)."""
    return b"event: error\ndata: " + json.dumps(error_body(status, message, code=code)).encode() + b"\n\n"
