"""The OpenAI-compatible endpoints ``/v1/completions`` and ``/v1/chat/completions``, streamed or not, and
``/tokenize``, which counts a prompt the way those endpoints would, and ``/tokenizer``, which hands out what
``/tokenize`` counts with.

A request is validated completely (pydantic; then the model name, the prompt and the context window by
engine/prompting/prompts.py, exactly as the guard checks them; then the engine's own checks in
``make_request``) before it reaches the scheduler, so a refusal leaves the engine untouched. Once added, the
engine request lives exactly as long as its handler: a client that disconnects cancels the handler (the
server runs with ``handler_cancellation``), which aborts the request and frees its blocks at the next step.

Streamed text: each chunk carries what a choice's text gained since the previous chunk. With stop strings
the last ``len(longest stop) - 1`` characters are held back until the choice finishes, because they may be
the start of a stop string, which is cut from the output and must never have been sent.
"""

from __future__ import annotations

import time
import uuid
from typing import Protocol, TypeVar, cast

from aiohttp import web
from pydantic import ValidationError

from engine.core import EngineCore
from engine.outputs import CompletionOutput, RequestOutput
from engine.prompting.chat_template import ChatTemplate
from engine.prompting.prompts import PromptCounter, check_context
from engine.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    FinishReason,
    PromptTokensDetails,
    SamplingRequest,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
)
from engine.sampling_params import SamplingParams
from engine.sched.request import Request
from engine.server.async_engine import AsyncEngine
from engine.server.errors import ApiError
from engine.server.request_stream import EngineUnavailable, RequestFailed
from engine.server.sse import open_stream, send_data, send_done, send_error

TENANT_HEADER = "X-Tenant-Id"
MAX_TENANT_LENGTH = 128

Body = TypeVar("Body", bound=SamplingRequest)


class _Format(Protocol):
    """How one endpoint shapes its answers: a stream chunk, the usage chunk, or the whole response."""

    def chunk(self, index: int, text: str, finish_reason: FinishReason | None) -> str: ...

    def usage_chunk(self, usage: Usage) -> str: ...

    def whole(self, output: RequestOutput, usage: Usage) -> str: ...


class OpenAIHandlers:
    def __init__(self, engine: AsyncEngine, chat_template: ChatTemplate) -> None:
        self.engine = engine
        self.chat_template = chat_template
        self._counter: PromptCounter | None = None  # built from the core once the model has loaded

    async def completions(self, http: web.Request) -> web.StreamResponse:
        body = await _parse(http, CompletionRequest)
        core, counter = self._ready()
        prompt_ids = counter.request_ids(body)
        check_context(body, len(prompt_ids), counter.max_model_len)
        request = _make_request(core, f"cmpl-{uuid.uuid4().hex}", prompt_ids, body, body.max_tokens,
                                _tenant(http), {})
        fmt = _CompletionFormat(request.request_id, core.model_name)
        return await self._respond(http, request, body, fmt)

    async def chat_completions(self, http: web.Request) -> web.StreamResponse:
        body = await _parse(http, ChatCompletionRequest)
        core, counter = self._ready()
        prompt_ids = counter.request_ids(body)
        check_context(body, len(prompt_ids), counter.max_model_len)
        rename = {"prompt": "messages", "max_tokens": body.max_output_tokens_field}
        request = _make_request(core, f"chatcmpl-{uuid.uuid4().hex}", prompt_ids, body, body.max_output_tokens,
                                _tenant(http), rename)
        fmt = _ChatFormat(request.request_id, core.model_name)
        return await self._respond(http, request, body, fmt)

    async def tokenize(self, http: web.Request) -> web.Response:
        """``POST /tokenize``: the prompt's token ids exactly as a completion or chat request would see them
        (a client without ``GET /tokenizer``'s counter can count with it)."""
        body = await _parse(http, TokenizeRequest)
        _, counter = self._ready()
        ids = counter.request_ids(body)
        answer = TokenizeResponse(count=len(ids), max_model_len=counter.max_model_len, tokens=ids)
        return web.Response(text=answer.model_dump_json(), content_type="application/json")

    async def tokenizer(self, _: web.Request) -> web.Response:
        """``GET /tokenizer``: what ``/tokenize`` counts with, so that a client (the guard) can rebuild the
        same ``PromptCounter`` and save a round trip per request."""
        _, counter = self._ready()
        return web.Response(text=counter.describe().model_dump_json(), content_type="application/json")

    def _ready(self) -> tuple[EngineCore, PromptCounter]:
        """The loaded core (``EngineUnavailable`` while there is none) and the counter of its model."""
        core = self.engine.core
        if self._counter is None:
            self._counter = PromptCounter(core.model_name, core.max_model_len, core.tokenizer, self.chat_template)
        return core, self._counter

    async def _respond(self, http: web.Request, request: Request, body: SamplingRequest,
                       fmt: _Format) -> web.StreamResponse:
        if body.stream:
            return await self._stream(http, request, body.include_usage, fmt)
        async with self.engine.generate(request) as stream:
            output = await stream.final()
        return web.Response(text=fmt.whole(output, _usage(output)), content_type="application/json")

    async def _stream(self, http: web.Request, request: Request, include_usage: bool,
                      fmt: _Format) -> web.StreamResponse:
        response = await open_stream(http)
        holdback = max((len(s) for s in request.params.stop or []), default=1) - 1
        sent: dict[int, int] = {}  # choice index -> characters of its text already sent
        ended: set[int] = set()
        output: RequestOutput | None = None
        try:
            async with self.engine.generate(request) as stream:
                async for output in stream:
                    for completion in output.outputs:
                        if completion.index not in ended:
                            await self._send_delta(response, fmt, completion, sent, holdback)
                            if completion.finish_reason is not None:
                                ended.add(completion.index)
        except (RequestFailed, EngineUnavailable) as exc:
            await send_error(response, ApiError.from_engine(exc))
            return response
        except ConnectionResetError:
            return response  # the client left; leaving ``generate`` has aborted the request
        assert output is not None and output.finished
        if include_usage:
            await send_data(response, fmt.usage_chunk(_usage(output)))
        await send_done(response)
        return response

    @staticmethod
    async def _send_delta(response: web.StreamResponse, fmt: _Format, completion: CompletionOutput,
                          sent: dict[int, int], holdback: int) -> None:
        start = sent.get(completion.index, 0)
        final = completion.finish_reason is not None
        end = len(completion.text) if final else max(start, len(completion.text) - holdback)
        if end > start or final:
            await send_data(response, fmt.chunk(completion.index, completion.text[start:end],
                                                _finish_reason(completion)))
            sent[completion.index] = end


async def _parse(http: web.Request, model: type[Body]) -> Body:
    raw = await http.read()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise ApiError.from_validation(exc) from None


def _tenant(http: web.Request) -> str | None:
    """The tenant named by the trusted ``X-Tenant-Id`` header (only the guard sets it)."""
    tenant = http.headers.get(TENANT_HEADER)
    if tenant is not None and not (0 < len(tenant) <= MAX_TENANT_LENGTH and tenant.isprintable()):
        raise ApiError(400, f"{TENANT_HEADER}: must be 1 to {MAX_TENANT_LENGTH} printable characters",
                       param=TENANT_HEADER)
    return tenant


def _make_request(core: EngineCore, request_id: str, prompt: list[int], body: SamplingRequest,
                  max_tokens: int | None, tenant: str | None, rename: dict[str, str]) -> Request:
    try:
        params = SamplingParams(n=body.n, max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                top_k=body.top_k, seed=body.seed, stop=body.stop, ignore_eos=body.ignore_eos)
        return core.make_request(prompt, params, request_id=request_id, tenant=tenant, cache_salt=body.cache_salt,
                                 priority=body.priority, stream=body.stream)
    except ValueError as exc:
        raise ApiError.invalid(exc, rename) from None


def _usage(output: RequestOutput) -> Usage:
    prompt = len(output.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in output.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens))


def _finish_reason(completion: CompletionOutput) -> FinishReason | None:
    # "abort" never reaches a client: only a handler that is already gone aborts its request.
    return cast(FinishReason, completion.finish_reason) if completion.finish_reason in ("stop", "length") else None


class _CompletionFormat:
    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())

    def _response(self, choices: list[CompletionChoice], usage: Usage | None = None) -> str:
        return CompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                  usage=usage).model_dump_json()

    def chunk(self, index: int, text: str, finish_reason: FinishReason | None) -> str:
        return self._response([CompletionChoice(index=index, text=text, finish_reason=finish_reason)])

    def usage_chunk(self, usage: Usage) -> str:
        return self._response([], usage)

    def whole(self, output: RequestOutput, usage: Usage) -> str:
        return self._response([CompletionChoice(index=c.index, text=c.text, finish_reason=_finish_reason(c))
                               for c in output.outputs], usage)


class _ChatFormat:
    """Chat chunks; a choice's first chunk also carries ``role`` (no separate empty role-only chunk, so the
    first event a client sees is its first token)."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self._started: set[int] = set()

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                   usage=usage).model_dump_json()

    def chunk(self, index: int, text: str, finish_reason: FinishReason | None) -> str:
        role = None if index in self._started else "assistant"
        self._started.add(index)
        delta = ChatDelta(role=role, content=text or None)
        return self._chunk([ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)])

    def usage_chunk(self, usage: Usage) -> str:
        return self._chunk([], usage)

    def whole(self, output: RequestOutput, usage: Usage) -> str:
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text), finish_reason=_finish_reason(c))
                   for c in output.outputs]
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                      usage=usage).model_dump_json()
