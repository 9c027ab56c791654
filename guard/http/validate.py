"""Request validation before anything is queued or forwarded.

The body is read with a hard size cap (413), must be JSON of the right content type and pass the engine's
own pydantic request models (400 with ``param`` naming the field: ``Content-Type`` or ``body`` when the
fault is not in one field, so that every 400 points somewhere); guard/http/tokens.py then counts the prompt
and checks it against the context window. Client-sent ``cache_salt``, ``priority`` and tenant hints are
dropped: the guard sets them from the tenant. A Responses body is also checked as the chat it runs as
(``counted``), which is what guard/http/tokens.py counts. Every stream asks its engine for usage, so that the guard
charges what was generated, not the events it saw (guard/wire/relay.py strips the usage chunk again from the
answer of a client that did not ask for it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pydantic_core
from aiohttp import web
from pydantic import BaseModel, ValidationError

from engine import protocol
from engine.protocol.responses import RENAME as RESPONSES_FIELDS
from guard.errors import GuardError

RESPONSES = "/v1/responses"
MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": protocol.CompletionRequest,
    "/v1/chat/completions": protocol.ChatCompletionRequest,
    RESPONSES: protocol.ResponsesRequest,
}
# Fields a client may not choose: the guard derives them from the authenticated tenant.
GUARD_OWNED = ("cache_salt", "priority", "tenant", "tenant_id", "x_tenant_id")
# Left out of the body sent upstream: the guard's own fields, the bound it sets under its own name, and
# resuming, which the guard does itself (guard/http/migrate.py).
NOT_FORWARDED = frozenset((*GUARD_OWNED, "max_completion_tokens", "resume_token_ids", "request_id",
                           "return_token_ids", "resume_sequence_number"))


@dataclass(slots=True)
class ParsedRequest:
    path: str
    body: dict  # the client's JSON, forwarded with the guard's changes only
    model: protocol.CompletionRequest | protocol.ChatCompletionRequest | protocol.ResponsesRequest
    # What is counted and sized: the request itself, or for a Responses body the chat it runs as.
    counted: protocol.CompletionRequest | protocol.ChatCompletionRequest = None  # type: ignore[assignment]
    # Read from ``model`` once (the stages ask several times a request; a property is a call each time).
    stream: bool = field(init=False)
    n: int = field(init=False)
    max_tokens: int | None = field(init=False)  # the client's bound on the output, if any
    # A stream whose client did not ask for usage: the guard asks for it upstream (``upstream_body``) and
    # removes the usage chunk from what the client gets (``StreamObserver.strip_usage``).
    adds_usage: bool = field(init=False)

    def __post_init__(self) -> None:
        model = self.model
        if self.counted is None:
            self.counted = model.to_chat([]) if isinstance(model, protocol.ResponsesRequest) else model
        self.stream, self.n, self.max_tokens = model.stream, model.n, model.max_output_tokens
        self.adds_usage = model.stream and not model.include_usage

    def upstream_body(self, cache_salt: str, max_tokens: int | None, priority: int, model: str | None = None) -> bytes:
        """The body sent to an engine: the client's, with the guard's salt, priority and token bound (and the
        fallback engine's model name when it serves a different one). A stream always asks for usage."""
        bound = "max_output_tokens" if self.path == RESPONSES else "max_tokens"
        body = {k: v for k, v in self.body.items() if k not in NOT_FORWARDED}
        body.update(cache_salt=cache_salt, priority=priority)
        if self.adds_usage:  # the client's other stream options stay as it sent them
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        if max_tokens is not None:
            body[bound] = max_tokens
        if model is not None:
            body["model"] = model
        return pydantic_core.to_json(body)


async def parse_request(request: web.Request, max_body_bytes: int) -> ParsedRequest:
    length = request.content_length
    if length is not None and length > max_body_bytes:
        raise GuardError(413, f"request body of {length} bytes exceeds the {max_body_bytes}-byte limit",
                         code="request_too_large")
    # The usual header as is, or else aiohttp's parse of it (which costs more than the rest of this check).
    if request.headers.get("Content-Type") != "application/json" and request.content_type != "application/json":
        raise GuardError(400, f"Content-Type must be application/json, got {request.content_type!r}",
                      param="Content-Type", code="invalid_content_type")
    content = request.content
    if content.is_eof():  # the whole body came with the headers (a small one does): take it as it lies
        raw = content.read_nowait()
    else:
        try:
            raw = await request.read()  # aiohttp stops reading past client_max_size, just above max_body_bytes
        except web.HTTPRequestEntityTooLarge:
            raw = None
    if raw is None or len(raw) > max_body_bytes:
        raise GuardError(413, f"request body exceeds the {max_body_bytes}-byte limit", code="request_too_large")
    try:
        body = pydantic_core.from_json(raw)  # as json.loads, but several times faster on small bodies
    except ValueError as exc:
        raise GuardError(400, f"the body is not valid JSON: {exc}", param="body", code="invalid_json") from None
    if not isinstance(body, dict):
        raise GuardError(400, "the body must be a JSON object", param="body", code="invalid_json")
    if request.path == RESPONSES:
        body.pop("history", None)  # the guard's to set (a continuation's, guard/http/responses.py)
    try:
        model = MODELS[request.path].model_validate(body)  # type: ignore[assignment]
        counted = model.to_chat([]) if isinstance(model, protocol.ResponsesRequest) else model
    except ValidationError as exc:
        param, message = protocol.validation_error_param(exc)
        if request.path == RESPONSES:  # the chat's field, as the Responses request names it
            param = RESPONSES_FIELDS.get(param or "", param)
        raise GuardError(400, message, param=param, code="invalid_value") from None
    return ParsedRequest(request.path, body, model, counted)
