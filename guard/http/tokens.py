"""Prompt token counts, exactly as the engine counts them, and the check against its context window.

The guard asks the engine once for its tokenizer (``GET /tokenizer``, as soon as the engine's telemetry
names its model, so no request waits for it) and then counts every prompt itself with the same tokenizer
(UTF-8 bytes for the built-in model, else ``tokenizer.json`` through the ``tokenizers`` package) and the
same chat template, so a count always equals the engine's ``/tokenize`` and costs no round trip (that
round trip was a fifth of the guard's CPU per request). An engine that has no ``/tokenizer`` (another
server) is asked ``POST /tokenize`` for each request instead. The tokenizer is
fetched again when the engine's telemetry names another model, so a restarted engine is never miscounted.
Prompts longer than ``THREAD_THRESHOLD_CHARS`` are encoded on a worker thread, so that one huge prompt does
not hold up every stream the guard relays.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
import tokenizers

from engine.prompting.chat_template import ChatTemplate, ChatTemplateError
from engine.prompting.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from engine.protocol import ChatCompletionRequest, TokenizerInfo
from guard.http.validate import Invalid, ParsedRequest

THREAD_THRESHOLD_CHARS = 16_384


@dataclass(slots=True)
class TokenLimits:
    prompt_tokens: int
    max_tokens: int  # what the request may generate: the client's bound, or what the context leaves


class LocalTokenizer:
    """The engine's tokenizer and chat template, rebuilt from its ``GET /tokenizer`` answer."""

    def __init__(self, info: TokenizerInfo) -> None:
        self.model = info.model
        self.max_model_len = info.max_model_len
        self.tokenizer: Tokenizer | None = None
        if info.kind == "bytes":
            self.tokenizer = ByteTokenizer()
        elif info.kind == "hf":
            if info.tokenizer_json is None:
                raise ValueError("GET /tokenizer: kind 'hf' without tokenizer_json")
            # Only encode is used here, so the special ids (which only decoding needs) stay empty.
            self.tokenizer = HFTokenizer(tokenizers.Tokenizer.from_str(info.tokenizer_json), (), None)
        self.template = ChatTemplate(info.chat_template, info.bos_token, info.eos_token)

    def count(self, parsed: ParsedRequest) -> int:
        """The prompt's length in tokens, or ``Invalid`` with the 400 the engine's ``/tokenize`` would give."""
        request = parsed.model
        if request.model != self.model:
            raise Invalid(400, f"model: {request.model!r} is not served here; this engine serves {self.model!r}",
                          param="model", code="model_not_found")
        if isinstance(request, ChatCompletionRequest):
            if self.tokenizer is None:
                raise Invalid(400, "messages: this model has no tokenizer; send token ids to /v1/completions",
                              param="messages")
            try:
                text = self.template.render(request.messages)
            except ChatTemplateError as exc:
                raise Invalid(400, str(exc), param="messages") from None
            return len(self.tokenizer.encode(text, add_special_tokens=False))
        prompt = request.single_prompt
        if isinstance(prompt, list):
            return len(prompt)
        if self.tokenizer is None:
            raise Invalid(400, "prompt: this model has no tokenizer; send token ids", param="prompt")
        return len(self.tokenizer.encode(prompt))


class TokenCounter:
    """Counts prompt tokens as the engine does and checks them against its context window."""

    def __init__(self, session: aiohttp.ClientSession, engine_url: str, timeout_s: float) -> None:
        self.session = session
        self.base = engine_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s * 2)
        self.local: LocalTokenizer | None = None
        self.remote_only = False  # the engine has no GET /tokenizer: ask POST /tokenize every time
        self._fetching: asyncio.Future[None] | None = None
        self._prefetched_for: str | None = None  # the model on_model last started a fetch for

    def on_model(self, model: str) -> None:
        """The engine's telemetry names its model: a different one than counted for means fetch again. The
        fetch starts now, once per model named, so that no request has to wait for it."""
        if self.local is not None and self.local.model != model:
            self.local = None
        if self.local is None and not self.remote_only and model != self._prefetched_for:
            self._prefetched_for = model  # a fetch that fails is left to the next request, not every snapshot
            self._start_fetch()

    async def count(self, parsed: ParsedRequest) -> TokenLimits:
        if self.local is None and not self.remote_only:
            await self._fetch_tokenizer()
        if self.local is not None:
            local = self.local
            if _prompt_chars(parsed) > THREAD_THRESHOLD_CHARS:
                prompt = await asyncio.to_thread(local.count, parsed)
            else:
                prompt = local.count(parsed)
            window = local.max_model_len
        else:
            prompt, window = await self._ask(parsed)
        return _check_window(parsed, prompt, window)

    async def _fetch_tokenizer(self) -> None:
        """One fetch at a time: requests that arrive meanwhile wait for it instead of sending their own, and
        one that leaves does not cancel it for the others."""
        await asyncio.shield(self._start_fetch())

    def _start_fetch(self) -> asyncio.Future[None]:
        if self._fetching is None:
            self._fetching = asyncio.ensure_future(self._get_tokenizer())
            self._fetching.add_done_callback(self._fetched)
        return self._fetching

    def _fetched(self, fetching: asyncio.Future[None]) -> None:
        self._fetching = None  # a failed fetch is tried again by the next request
        if not fetching.cancelled():
            fetching.exception()  # retrieved here too, in case every waiter has left

    async def _get_tokenizer(self) -> None:
        try:
            async with self.session.get(self.base + "/tokenizer", timeout=self.timeout) as response:
                if response.status in (404, 405):
                    self.remote_only = True
                    return
                raw = await response.read()
                if response.status != 200:
                    raise Invalid(503, "the engine is unavailable", code="engine_unavailable", retry_after=1)
        except (aiohttp.ClientError, TimeoutError):
            raise Invalid(503, "the engine is unavailable", code="engine_unavailable", retry_after=1) from None
        try:
            self.local = LocalTokenizer(TokenizerInfo.model_validate_json(raw))
        except ValueError as exc:  # includes pydantic's ValidationError and a tokenizer.json that will not load
            raise Invalid(502, f"the engine's GET /tokenizer answer is unusable: {exc}",
                          code="bad_upstream_response") from None

    async def _ask(self, parsed: ParsedRequest) -> tuple[int, int]:
        query = {key: parsed.body[key] for key in ("model", "prompt", "messages") if key in parsed.body}
        try:
            async with self.session.post(self.base + "/tokenize", json=query, timeout=self.timeout) as response:
                answer = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            raise Invalid(503, "the engine is unavailable", code="engine_unavailable", retry_after=1) from None
        if response.status != 200:
            error = answer.get("error", {}) if isinstance(answer, dict) else {}
            raise Invalid(response.status if response.status < 500 else 503,
                          error.get("message", "the engine could not tokenize the prompt"),
                          param=error.get("param"), code=error.get("code"))
        return int(answer["count"]), int(answer["max_model_len"])


def _prompt_chars(parsed: ParsedRequest) -> int:
    request = parsed.model
    if isinstance(request, ChatCompletionRequest):
        return sum(len(message.text) for message in request.messages)
    prompt = request.single_prompt
    return 0 if isinstance(prompt, list) else len(prompt)


def _check_window(parsed: ParsedRequest, prompt: int, window: int) -> TokenLimits:
    prompt_field = "messages" if "messages" in parsed.body else "prompt"
    if prompt >= window:
        raise Invalid(400, f"the prompt has {prompt} tokens; the context window is {window}",
                      param=prompt_field, code="context_length_exceeded")
    room = window - prompt
    requested = parsed.max_tokens
    if requested is not None and requested > room:
        raise Invalid(400, f"{parsed.max_tokens_field} {requested} plus the {prompt}-token prompt exceeds the "
                      f"context window of {window} tokens", param=parsed.max_tokens_field,
                      code="context_length_exceeded")
    return TokenLimits(prompt, requested if requested is not None else room)
