"""The OpenAI-compatible endpoints ``/v1/completions`` and ``/v1/chat/completions``, streamed or not, and
``/tokenize``, which counts a prompt the way those endpoints would, and ``/tokenizer``, which hands out what
``/tokenize`` counts with.

A request is validated completely (pydantic; then the model name, the prompt and the context window by
engine/prompting/prompts.py, exactly as the guard checks them; then the engine's own checks in
``make_request``) before it reaches the scheduler, so a refusal leaves the engine untouched. Once added, the
engine request lives exactly as long as its handler: a client that disconnects cancels the handler (the
server runs with ``handler_cancellation``), which aborts the request and frees its blocks at the next step.

A ``/v1/completions`` batch (``prompt`` a list of prompts) becomes one engine request per prompt, all added
together and living as long as the handler: one that fails fails the whole answer (the others are aborted),
and choice ``i`` of prompt ``p`` is the answer's choice ``p * n + i``, as OpenAI numbers them; usage sums
over the prompts.

Streamed text: each chunk carries what a choice's text gained since the previous chunk. With stop strings
the last ``len(longest stop) - 1`` characters are held back until the choice finishes, because they may be
the start of a stop string, which is cut from the output and must never have been sent.

Structured outputs (engine/structured): ``response_format`` and forced tool calls compile to a grammar off
the event loop (a new schema takes milliseconds, the engine's first one a second or two), and a schema the
engine cannot follow is a 400 before anything is queued. A tool-call choice is read from its finished text
(``message.tool_calls``, ``content`` null, finish_reason ``tool_calls``); streamed, it opens with a chunk
carrying the role at its first token, then each call's arguments as deltas as the model writes them (the
call's first delta names it), as OpenAI streams calls (engine/structured/call_stream.py). A choice cut by
``max_tokens`` ends with finish_reason ``length`` and the calls as far as written; one in which no call had
begun comes back as text.

Resuming (``resume_token_ids``, engine/output_processor.py): the answer continues an interrupted one, whose
id ``request_id`` names (every id in the answer derives from it: tool call ids too), and carries only what
comes after what that answer had sent; its ``usage`` is the whole completion's, as if uninterrupted. A
stream with ``return_token_ids`` has each event carry the token ids its choice gained since the previous
one, as a comment line before it (``: token_ids <choice index> <id>,<id>...``), also where the event itself
is withheld (a tool-call choice whose text opened nothing yet); a client that resumes such a stream after
its last complete event sends the concatenated ids. A comment's next line is another comment, the data
line of its choice's token chunk, or (the stream failing) an error event: a choice's last event carries
its finish reason and is never withheld, so no comment comes right before the usage chunk or the end (the
guard counts on it, guard/wire/resume_tap.py ``token_event``). A resumed stream does not repeat a chat
choice's ``role``. A non-streamed resumed tool call is refused: its calls are only whole with what was sent
before.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

from aiohttp import web
from pydantic import ValidationError

from engine.core import EngineCore
from engine.outputs import CompletionOutput, RequestOutput
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
    FunctionCallDelta,
    PromptTokensDetails,
    SamplingRequest,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallDelta,
    Usage,
    sse_data,
)
from engine.request_stream import EngineDraining, EngineUnavailable, RequestFailed, RequestStream
from engine.sampling_params import SamplingParams
from engine.sched.request import Request
from engine.server import tracing
from engine.server.async_engine import AsyncEngine
from engine.server.errors import ApiError
from engine.server.sse import open_stream, send_data, send_done, send_error
from engine.structured.call_stream import CallScanner
from engine.structured.spec import Grammar, GrammarSpec, response_format_grammar
from engine.structured.tool_calls import ToolCalling

TENANT_HEADER = "X-Tenant-Id"
MAX_TENANT_LENGTH = 128

Body = TypeVar("Body", bound=SamplingRequest)


class _Format(Protocol):
    """How one endpoint shapes its answers: a stream chunk (None: the text so far says nothing new to the
    client yet), the usage chunk, or the whole response."""

    def chunk(self, index: int, text: str, finish_reason: FinishReason | None) -> str | None: ...

    def usage_chunk(self, usage: Usage) -> str: ...

    def whole(self, outputs: list[RequestOutput], usage: Usage) -> str: ...


class OpenAIHandlers:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._counter: PromptCounter | None = None  # built from the core once the model has loaded

    async def completions(self, http: web.Request) -> web.StreamResponse:
        body = await parse_body(http, CompletionRequest)
        self._admitting()
        core, counter = self._ready()
        batch = counter.batch_ids(body)
        for prompt_ids in batch:
            check_context(body, len(prompt_ids), counter.max_model_len)
        if body.resume_token_ids is not None and len(batch) > 1:
            raise ApiError(400, f"resume_token_ids: resumes one prompt, not a batch of {len(batch)}",
                           param="resume_token_ids")
        tenant, completion_id = tenant_of(http), f"cmpl-{_answer_key(body)}"
        # A batch's engine requests are told apart by a suffix; the answer carries the one id.
        ids = [completion_id] if len(batch) == 1 else [f"{completion_id}-{p}" for p in range(len(batch))]
        grammar = await _compile(core, response_format_grammar(body.response_format))
        requests = [_make_request(core, answer_id, prompt_ids, body, body.max_tokens, tenant, {}, grammar)
                    for answer_id, prompt_ids in zip(ids, batch, strict=True)]
        return await self._respond(http, requests, body, _CompletionFormat(completion_id, body.model))

    async def chat_completions(self, http: web.Request) -> web.StreamResponse:
        body = await parse_body(http, ChatCompletionRequest)
        answer_id = f"chatcmpl-{_answer_key(body)}"
        request, tools = await self.chat_request(body, tenant_of(http), answer_id)
        return await self._respond(http, [request], body, _ChatFormat(answer_id, body.model, tools, request.resume_text))

    async def chat_request(self, body: ChatCompletionRequest, tenant: str | None, answer_id: str
                           ) -> tuple[Request, ToolCalling | None]:
        """The engine request that answers a chat, and how its text becomes tool calls (None: it is text):
        counted, checked against the context window, its grammar compiled. /v1/responses comes this way too."""
        self._admitting()
        core, counter = self._ready()
        prompt_ids = counter.request_ids(body)
        check_context(body, len(prompt_ids), counter.max_model_len)
        rename = {"prompt": "messages", "max_tokens": body.max_output_tokens_field}
        tools = ToolCalling.of(body)
        if tools is not None and body.resume_token_ids and not body.stream:
            raise ApiError(400, "resume_token_ids: a tool call resumes as a stream only (its calls are whole "
                           "only with what the interrupted answer sent)", param="resume_token_ids")
        grammar = await _compile(core, tools.grammar() if tools is not None else
                                 response_format_grammar(body.response_format))
        return _make_request(core, answer_id, prompt_ids, body, body.max_output_tokens, tenant, rename,
                             grammar), tools

    async def tokenize(self, http: web.Request) -> web.Response:
        """``POST /tokenize``: the prompt's token ids exactly as a completion or chat request would see them
        (a client without ``GET /tokenizer``'s counter can count with it)."""
        body = await parse_body(http, TokenizeRequest)
        _, counter = self._ready()
        ids = counter.request_ids(body)
        answer = TokenizeResponse(count=len(ids), max_model_len=counter.max_model_len, tokens=ids)
        return web.Response(text=answer.model_dump_json(), content_type="application/json")

    async def tokenizer(self, _: web.Request) -> web.Response:
        """``GET /tokenizer``: what ``/tokenize`` counts with, so that a client (the guard) can rebuild the
        same ``PromptCounter`` and save a round trip per request."""
        _, counter = self._ready()
        return web.Response(text=counter.describe().model_dump_json(), content_type="application/json")

    def _admitting(self) -> None:
        """``EngineDraining`` (a 503 with Retry-After) once the engine drains: new work goes elsewhere."""
        if self.engine.draining:
            raise EngineDraining("the engine is draining (shutting down): send the request to another replica")

    def _ready(self) -> tuple[EngineCore, PromptCounter]:
        """The loaded core (``EngineUnavailable`` while there is none) and the counter of its model."""
        core = self.engine.core
        if self._counter is None:
            self._counter = PromptCounter(core.model_name, core.max_model_len, core.tokenizer,
                                          core.loaded.chat_template, core.loras.adapters if core.loras else ())
        return core, self._counter

    async def _respond(self, http: web.Request, requests: list[Request], body: SamplingRequest,
                       fmt: _Format) -> web.StreamResponse:
        timelines = tracing.timelines_for(http, requests)
        if body.stream:
            return await self._stream(http, requests, timelines, body, fmt)
        async with self.generate(requests, timelines) as streams:
            outputs = list(await asyncio.gather(*(stream.final() for stream in streams)))
        return web.Response(text=fmt.whole(outputs, _usage(outputs)), content_type="application/json")

    @asynccontextmanager
    async def generate(self, requests: list[Request], timelines: list[tracing.Timeline | None]
                        ) -> AsyncIterator[list[RequestStream]]:
        """``generate`` for all of ``requests`` at once: each is added before any step can run, and leaving
        the block early (an error, one request failing, a cancelled handler) aborts every one still running."""
        async with AsyncExitStack() as stack:
            yield [await stack.enter_async_context(self.engine.generate(request, timeline))
                   for request, timeline in zip(requests, timelines, strict=True)]

    async def _stream(self, http: web.Request, requests: list[Request], timelines: list[tracing.Timeline | None],
                      body: SamplingRequest, fmt: _Format) -> web.StreamResponse:
        response = await open_stream(http)
        stops = requests[0].params.stop or []
        holdback = max((len(s) for s in stops), default=1) - 1
        n = requests[0].params.n
        sent = _Sent({}, {} if body.return_token_ids else None)
        ended: set[int] = set()
        finals: dict[int, RequestOutput] = {}  # prompt index -> its request's final output
        try:
            async with self.generate(requests, timelines) as streams, aclosing(_merged(streams)) as merged:
                async for prompt, output in merged:
                    for completion in output.outputs:
                        index = prompt * n + completion.index
                        if index not in ended:
                            await _send_delta(response, fmt, index, completion, sent, holdback)
                            if completion.finish_reason is not None:
                                ended.add(index)
                    if output.finished:
                        finals[prompt] = output
        except (RequestFailed, EngineUnavailable) as exc:
            await send_error(response, ApiError.from_engine(exc))
            return response
        except ConnectionResetError:
            return response  # the client left; leaving ``generate`` has aborted the requests
        assert len(finals) == len(requests)
        if body.include_usage:
            await send_data(response, fmt.usage_chunk(_usage(list(finals.values()))))
        await send_done(response)
        return response



@dataclass(slots=True)
class _Sent:
    """How far a stream has sent each choice (its index -> characters of text; with ``return_token_ids``,
    token ids too: None without)."""

    chars: dict[int, int]
    tokens: dict[int, int] | None


async def _send_delta(response: web.StreamResponse, fmt: _Format, index: int, completion: CompletionOutput,
                      sent: _Sent, holdback: int) -> None:
    """Send what choice ``index`` gained, but its last ``holdback`` characters (all of it once it ends); its
    token ids go with what it sends (see the module docstring)."""
    start = sent.chars.get(index, 0)
    final = completion.finish_reason is not None
    end = len(completion.text) if final else max(start, len(completion.text) - holdback)
    if end > start or final:
        sent.chars[index] = end
        chunk = fmt.chunk(index, completion.text[start:end], _finish_reason(completion))
        data = sse_data(chunk) if chunk is not None else b""
        if sent.tokens is not None and completion.num_tokens > (first := sent.tokens.get(index, 0)):
            sent.tokens[index] = completion.num_tokens
            data = b": token_ids %d %s\n" % (index, ",".join(map(str, completion.token_ids_from(first))).encode()
                                              ) + data
        if data:
            await response.write(data)


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of ``streams`` as each comes, tagged with its stream's position, until every stream has
    given its final one; raises the first request error. A stream holds only its newest output, so waiting
    on each stream's next one (and cancelling those waits on the way out) loses nothing and changes nothing."""
    waits = {asyncio.ensure_future(anext(stream)): position for position, stream in enumerate(streams)}
    try:
        while waits:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for wait in done:
                position = waits.pop(wait)
                output = wait.result()
                yield position, output
                if not output.finished:
                    waits[asyncio.ensure_future(anext(streams[position]))] = position
    finally:
        for wait in waits:
            wait.cancel()


async def parse_body(http: web.Request, model: type[Body]) -> Body:
    raw = await http.read()
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise ApiError.from_validation(exc) from None


def tenant_of(http: web.Request) -> str | None:
    """The tenant named by the trusted ``X-Tenant-Id`` header (only the guard sets it)."""
    tenant = http.headers.get(TENANT_HEADER)
    if tenant is not None and not (0 < len(tenant) <= MAX_TENANT_LENGTH and tenant.isprintable()):
        raise ApiError(400, f"{TENANT_HEADER}: must be 1 to {MAX_TENANT_LENGTH} printable characters",
                       param=TENANT_HEADER)
    return tenant


async def _compile(core: EngineCore, spec: GrammarSpec | None) -> Grammar | None:
    """``spec`` compiled on a worker thread, so that compiling never stalls the event loop."""
    if spec is None:
        return None
    try:
        return await asyncio.to_thread(core.compile_grammar, spec)
    except ValueError as exc:
        raise ApiError.invalid(exc) from None


def _make_request(core: EngineCore, answer_id: str, prompt: list[int], body: SamplingRequest,
                  max_tokens: int | None, tenant: str | None, rename: dict[str, str],
                  grammar: Grammar | None) -> Request:
    """The engine request for one prompt of an answer whose ids derive from ``answer_id``. Its own id is that
    and a suffix of its own: two requests in flight may answer with one id (a client's ``request_id``, as a
    guard gives each choice of a stream it resumes choice by choice), where the engine, which keeps each
    request by its id, refuses a second running request with an id it runs already."""
    try:
        # OpenAI reads top_p=0 as "keep only the likeliest token": greedy, which temperature 0 says exactly
        # (and a nucleus of zero mass is no distribution to sample from).
        greedy = body.top_p == 0.0
        params = SamplingParams(n=body.n, max_tokens=max_tokens, temperature=0.0 if greedy else body.temperature,
                                top_p=1.0 if greedy else body.top_p, top_k=body.top_k, seed=body.seed,
                                stop=body.stop, ignore_eos=body.ignore_eos)
        return core.make_request(prompt, params, request_id=f"{answer_id}.{uuid.uuid4().hex[:8]}", tenant=tenant,
                                 cache_salt=body.cache_salt,
                                 priority=body.priority, stream=body.stream, grammar=grammar,
                                 lora=None if body.model == core.model_name else body.model,  # checked: served
                                 resume=body.resume_token_ids)
    except ValueError as exc:
        raise ApiError.invalid(exc, rename) from None


def _answer_key(body: SamplingRequest) -> str:
    """The id an answer's ids derive from: the request's ``request_id``, else a fresh one."""
    return body.request_id or uuid.uuid4().hex


def _usage(outputs: list[RequestOutput]) -> Usage:
    """The usage of a whole answer: summed over its requests (a batch's prompts) and their choices, a resumed
    completion's resumed tokens included."""
    prompt = sum(len(output.prompt_token_ids) for output in outputs)
    completion = sum(c.num_tokens + output.num_resumed_tokens for output in outputs for c in output.outputs)
    cached = sum(output.num_cached_tokens for output in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


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

    def whole(self, outputs: list[RequestOutput], usage: Usage) -> str:
        n = len(outputs[0].outputs)
        return self._response([CompletionChoice(index=prompt * n + c.index, text=c.text,
                                                finish_reason=_finish_reason(c))
                               for prompt, output in enumerate(outputs) for c in output.outputs], usage)


class _ChatFormat:
    """Chat chunks; a choice's first chunk also carries ``role`` (no separate empty role-only chunk, so the
    first event a client sees is its first token). With ``tools``, the choices are tool calls, their
    arguments streamed as deltas."""

    def __init__(self, request_id: str, model: str, tools: ToolCalling | None, resumed_text: str = "") -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.tools = tools
        self._started: set[int] = set()
        self._scanners: dict[int, CallScanner] = {}  # with tools: each choice's calls as far as written
        if resumed_text:  # the interrupted stream sent the role, and the calls as far as that text goes
            self._started.add(0)
            if tools is not None:
                self._scanners[0] = tools.scanner(request_id)
                self._scanners[0].feed(resumed_text)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return ChatCompletionChunk(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                   usage=usage).model_dump_json()

    def chunk(self, index: int, text: str, finish_reason: FinishReason | None) -> str | None:
        role = None if index in self._started else "assistant"
        self._started.add(index)
        delta = ChatDelta(role=role, content=text or None)
        if self.tools is not None:
            delta, finish_reason = self._call_delta(index, text, finish_reason)
            if delta.tool_calls is None and delta.content is None and finish_reason is None and role is None:
                return None  # the text so far opens no call and adds to none
            delta.role = role
        return self._chunk([ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)])

    def _call_delta(self, index: int, text: str, finish_reason: FinishReason | None
                    ) -> tuple[ChatDelta, FinishReason | None]:
        """What choice ``index``'s calls gained from ``text``; as it ends, its finish reason, or its whole
        text as content if not one call had begun."""
        assert self.tools is not None
        scanner = self._scanners.get(index) or self._scanners.setdefault(index, self.tools.scanner(self.request_id))
        calls = [ToolCallDelta(index=d.index, id=d.call.id if d.opened else None,
                               type="function" if d.opened else None,
                               function=FunctionCallDelta(name=d.call.name if d.opened else None,
                                                          arguments=d.arguments))
                 for d in scanner.feed(text)]
        content = None
        if finish_reason is not None:
            message, finish_reason = _chat_message(scanner, finish_reason)
            content = message.content
        return ChatDelta(content=content, tool_calls=calls or None), finish_reason

    def usage_chunk(self, usage: Usage) -> str:
        return self._chunk([], usage)

    def whole(self, outputs: list[RequestOutput], usage: Usage) -> str:
        [output] = outputs  # a chat has one conversation
        choices = []
        for c in output.outputs:
            if self.tools is None:
                message, finish_reason = AssistantMessage(content=c.text), _finish_reason(c)
            else:
                scanner = self.tools.scanner(self.request_id)
                scanner.feed(c.text)
                message, finish_reason = _chat_message(scanner, _finish_reason(c))
            choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish_reason))
        return ChatCompletionResponse(id=self.request_id, created=self.created, model=self.model, choices=choices,
                                      usage=usage).model_dump_json()


def _chat_message(scanner: CallScanner, finish_reason: FinishReason | None
                  ) -> tuple[AssistantMessage, FinishReason | None]:
    """A finished tool-call choice's message and finish reason: its calls as far as written, ``tool_calls``
    when they are complete (a ``length`` cut keeps its reason); its text when not one call had begun."""
    calls = scanner.tool_calls()
    if not calls:
        return AssistantMessage(content=scanner.text), finish_reason
    if finish_reason == "stop" and scanner.complete():
        finish_reason = "tool_calls"
    return AssistantMessage(content=None, tool_calls=calls), finish_reason
