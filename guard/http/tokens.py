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

A ``/v1/completions`` batch is counted prompt by prompt, as the engine runs each as a request of its own:
every prompt must fit the window, and the one output bound the batch is sent with is the client's, or
(when it sets none) the room its longest prompt leaves, so that every prompt's reservation holds its output.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from engine.prompting.prompts import PromptCounter, PromptError, check_context
from engine.protocol import ChatCompletionRequest, TokenizerInfo
from engine.protocol.responses import RENAME as RESPONSES_FIELDS
from guard.errors import GuardError
from guard.http.validate import RESPONSES, ParsedRequest

THREAD_THRESHOLD_CHARS = 16_384


@dataclass(slots=True)
class TokenLimits:
    prompts: list[int]  # each prompt's tokens: one for a chat, one per prompt of a completion batch
    max_tokens: int  # what each prompt may generate: the client's bound, or what the context leaves
    ids: list[list[int]] | None = None  # each prompt's token ids; None when the engine counted them remotely

    @property
    def prompt_tokens(self) -> int:
        """The request's prompt tokens, all its prompts together (what usage reports and quotas charge)."""
        return sum(self.prompts)


class TokenCounter:
    """Counts prompt tokens as the engine does and checks them against its context window."""

    def __init__(self, session: aiohttp.ClientSession, engine_url: Callable[[], str], timeout_s: float) -> None:
        """``engine_url`` names a replica to ask (one that is up, when any is): all replicas of a pool serve
        the same model, so any of them counts alike."""
        self.session = session
        self.engine_url = engine_url
        self.timeout = aiohttp.ClientTimeout(total=timeout_s * 2)
        self.local: PromptCounter | None = None
        # LoRA adapters the replicas serve (guard/http/models.py learns them from telemetry): a request may
        # name one as its model, and it counts with the base model's tokenizer.
        self.adapters: frozenset[str] = frozenset()
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
        """The prompt's tokens and the output bound, or ``GuardError`` with the refusal the engine would give."""
        if self.local is None and not self.remote_only:
            await self._fetch_tokenizer()
        try:
            if self.local is not None:
                local = self.local
                if _prompt_chars(parsed) > THREAD_THRESHOLD_CHARS:
                    batch = await asyncio.to_thread(local.batch_ids, parsed.counted)
                else:
                    batch = local.batch_ids(parsed.counted)
                prompts, window = [len(ids) for ids in batch], local.max_model_len
            else:
                batch = None
                prompts, window = await self._ask(parsed)
            return TokenLimits(prompts, min([check_context(parsed.counted, prompt, window) for prompt in prompts]),
                               batch)
        except PromptError as exc:
            param = RESPONSES_FIELDS.get(exc.param, exc.param) if parsed.path == RESPONSES else exc.param
            raise GuardError(exc.status, str(exc), param=param, code=exc.code) from None

    def base(self) -> str:
        return self.engine_url().rstrip("/")

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
            async with self.session.get(self.base() + "/tokenizer", timeout=self.timeout) as response:
                if response.status in (404, 405):
                    self.remote_only = True
                    return
                raw = await response.read()
                if response.status != 200:
                    raise GuardError(503, "the engine is unavailable", code="engine_unavailable", retry_after=1)
        except (aiohttp.ClientError, TimeoutError):
            raise GuardError(503, "the engine is unavailable", code="engine_unavailable", retry_after=1) from None
        try:
            self.local = PromptCounter.from_info(TokenizerInfo.model_validate_json(raw))
            self.local.adapters = self.adapters
        except ValueError as exc:  # includes pydantic's ValidationError and a tokenizer.json that will not load
            raise GuardError(502, f"the engine's GET /tokenizer answer is unusable: {exc}",
                          code="bad_upstream_response") from None

    async def _ask(self, parsed: ParsedRequest) -> tuple[list[int], int]:
        """Each prompt's count and the context window, from the engine's ``POST /tokenize`` (one prompt per call)."""
        request = parsed.counted
        if isinstance(request, ChatCompletionRequest):
            messages = [message.model_dump(exclude_none=True) for message in request.messages]
            return await self._ask_one({"model": request.model, "messages": messages})
        counts, window = [], 0
        for prompt in request.prompts:
            count, window = await self._ask_one({"model": request.model, "prompt": prompt})
            counts += count
        return counts, window

    async def _ask_one(self, query: dict) -> tuple[list[int], int]:
        try:
            async with self.session.post(self.base() + "/tokenize", json=query, timeout=self.timeout) as response:
                answer = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            raise GuardError(503, "the engine is unavailable", code="engine_unavailable", retry_after=1) from None
        if response.status != 200:
            error = answer.get("error", {}) if isinstance(answer, dict) else {}
            raise GuardError(response.status if response.status < 500 else 503,
                          error.get("message", "the engine could not tokenize the prompt"),
                          param=error.get("param"), code=error.get("code"))
        return [int(answer["count"])], int(answer["max_model_len"])


def _prompt_chars(parsed: ParsedRequest) -> int:
    request = parsed.counted
    if isinstance(request, ChatCompletionRequest):
        return sum(len(message.text) for message in request.messages)
    chars = 0
    for prompt in request.prompts:  # a loop: a generator's frame costs more than the usual one prompt
        if isinstance(prompt, str):
            chars += len(prompt)
    return chars

