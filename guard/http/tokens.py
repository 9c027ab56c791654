"""Prompt token counts, exactly as the engine counts them, and the check against its context window.

The guard asks the engine once for its tokenizer (``GET /tokenizer``, as soon as the engine's telemetry
names its model, so no request waits for it) and rebuilds from it the ``PromptCounter`` the engine counts
with (engine/prompting/prompts.py: UTF-8 bytes for the built-in model, else ``tokenizer.json`` through the
``tokenizers`` package, and the same chat template). The guard then counts and refuses every prompt with the
very code the engine runs, so a count always equals the engine's ``/tokenize``, a refusal its 400 or 404, and
neither costs a round trip (that round trip was a fifth of the guard's CPU per request). An engine that has
no ``/tokenizer`` (another server) is asked ``POST /tokenize`` for each request instead. The tokenizer is
fetched again when the engine's telemetry names another model, so a restarted engine is never miscounted.
Prompts longer than ``THREAD_THRESHOLD_CHARS`` are encoded on a worker thread, so that one huge prompt does
not hold up every stream the guard relays.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp

from engine.prompting.prompts import PromptCounter, PromptError, check_context
from engine.protocol import ChatCompletionRequest, TokenizerInfo
from guard.http.validate import Invalid, ParsedRequest

THREAD_THRESHOLD_CHARS = 16_384


@dataclass(slots=True)
class TokenLimits:
    prompt_tokens: int
    max_tokens: int  # what the request may generate: the client's bound, or what the context leaves


class TokenCounter:
    """Counts prompt tokens as the engine does and checks them against its context window."""

    def __init__(self, session: aiohttp.ClientSession, engine_url: str, timeout_s: float) -> None:
        self.session = session
        self.base = engine_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s * 2)
        self.local: PromptCounter | None = None
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
        """The prompt's tokens and the output bound, or ``Invalid`` with the refusal the engine would give."""
        if self.local is None and not self.remote_only:
            await self._fetch_tokenizer()
        try:
            if self.local is not None:
                local = self.local
                if _prompt_chars(parsed) > THREAD_THRESHOLD_CHARS:
                    prompt = len(await asyncio.to_thread(local.request_ids, parsed.model))
                else:
                    prompt = len(local.request_ids(parsed.model))
                window = local.max_model_len
            else:
                prompt, window = await self._ask(parsed)
            return TokenLimits(prompt, check_context(parsed.model, prompt, window))
        except PromptError as exc:
            raise Invalid(exc.status, str(exc), param=exc.param, code=exc.code) from None

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
            self.local = PromptCounter.from_info(TokenizerInfo.model_validate_json(raw))
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

