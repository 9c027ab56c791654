"""A seeded multi-turn chat workload: the traffic that prefix-cache locality pays for (issue 15).

Each tenant has its own long system prompt; each of its conversations is a sequence of turns whose prompt
is the whole conversation so far (system prompt, earlier user messages and the assistant's answers, the new
user message), so the prompt's prefix grows turn by turn and every turn's prompt begins with the one before::

    turn 0   [system][user 0]
    turn 1   [system][user 0][answer 0][user 1]
    turn 2   [system][user 0][answer 0][user 1][answer 1][user 2]

The answer kept in the history is the text the engine streamed back, so the next prompt's prefix is what
the engine has just held in its KV blocks. Conversations run concurrently (their starts spread over
``stagger_s``); the turns of one conversation run in order, each sent when the previous answer has ended
(plus a seeded think time). Every text comes from ``seed``, and a tenant's texts from its position alone, not
its name, so runs under different tenant names (fresh cache salts) send the same prompts.

A turn that fails is sent again, as a chat client would, up to ``attempts`` times in all, ``retry_pause_s``
apart; a conversation whose turn fails every attempt ends there. Every attempt is one ``Turn`` record.

Used by ``bench/routing.py`` and ``tests/guard/test_pool_routing.py``; run as a module from the repository root
(``python -m bench.routing``) or imported with the root on ``sys.path`` (pytest puts it there).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

# Pseudo-words from a few syllables: ASCII, so the tiny model's byte tokenizer counts one token a character.
SYLLABLES = ("ka", "lo", "mi", "ter", "van", "sol", "re", "tu", "bel", "dan", "or", "pi", "sen", "qua", "mo",
             "rix", "gal", "ne", "fu", "zen")


@dataclass(frozen=True, slots=True)
class ChatWorkload:
    conversations: int = 4  # per tenant
    turns: int = 5  # per conversation
    system_words: int = 60  # each tenant's system prompt
    user_words: int = 30  # a user message's mean (each has from half to one and a half times this)
    max_tokens: int = 32  # each answer (``ignore_eos``: exactly this many tokens)
    stagger_s: float = 0.5  # conversation starts spread uniformly over this
    think_s: float = 0.0  # a pause of up to this between an answer and the next turn
    attempts: int = 1  # sends of a turn before its conversation gives up
    retry_pause_s: float = 0.25
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Conversation:
    tenant: str
    index: int  # within its tenant
    system: str
    users: tuple[str, ...]
    start_s: float  # after the workload's start
    think_s: tuple[float, ...]  # the pause after each turn


@dataclass(slots=True)
class Turn:
    """One request of a conversation. ``outcome``: ``completed`` (the stream reached ``[DONE]``),
    ``stream_error`` (a stream that ended with an SSE ``error`` event), ``refused`` (an answer other than
    200, in the OpenAI error shape), ``truncated`` (a stream or connection that ended with neither: a
    silent truncation), ``timeout`` (no end within the client's bound: a hang); None until it ends.
    Times are ``time.monotonic()``."""

    tenant: str
    conversation: int
    turn: int
    attempt: int
    sent: float
    status: int | None = None  # HTTP status; None before headers arrive
    backend: str | None = None  # X-Guard-Backend
    outcome: str | None = None
    error: str = ""  # the error's code (or message) for a stream_error or refused turn
    first_token: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0  # from the stream's usage chunk, as the engine counted them
    cached_tokens: int = 0
    completion_tokens: int = 0
    reply: list[str] = field(default_factory=list, repr=False)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent


def plan(workload: ChatWorkload, tenants: Sequence[str]) -> list[Conversation]:
    """Every conversation of the workload, tenant by tenant; the same ``seed`` gives the same texts."""
    conversations = []
    low, high = max(1, workload.user_words // 2), workload.user_words * 3 // 2
    for position, tenant in enumerate(tenants):
        system_rng = random.Random(f"{workload.seed}-system-{position}")
        system = f"You are assistant {position} of a company. " + _words(system_rng, workload.system_words)
        for index in range(workload.conversations):
            rng = random.Random(f"{workload.seed}-conversation-{position}-{index}")
            # Lengths vary, so that conversations drift out of step and no two take turns in lockstep.
            users = tuple(f"Question {turn}: " + _words(rng, rng.randint(low, high)) + "?"
                          for turn in range(workload.turns))
            conversations.append(Conversation(
                tenant, index, system, users, rng.uniform(0.0, workload.stagger_s),
                tuple(rng.uniform(0.0, workload.think_s) for _ in range(workload.turns))))
    return conversations


async def run_conversations(url: str, keys: dict[str, str], workload: ChatWorkload, model: str,
                            timeout_s: float = 60.0, turns: list[Turn] | None = None) -> list[Turn]:
    """Run every conversation of ``plan(workload, list(keys))`` against the guard at ``url`` (``keys``:
    tenant -> API key) and return each request's ``Turn`` in the order they were sent. ``turns``, when
    given, is filled in as the run goes (for a caller that watches it). No request outlives ``timeout_s``."""
    turns = [] if turns is None else turns
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # No connection cap: it would be a client-side queue in front of the one under test.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        origin = time.monotonic()
        await asyncio.gather(*(_converse(session, url, keys[c.tenant], c, workload, model, origin, turns)
                               for c in plan(workload, list(keys))))
    return turns


async def _converse(session: aiohttp.ClientSession, url: str, key: str, conversation: Conversation,
                    workload: ChatWorkload, model: str, origin: float, turns: list[Turn]) -> None:
    await asyncio.sleep(max(0.0, origin + conversation.start_s - time.monotonic()))
    history = [{"role": "system", "content": conversation.system}]
    for index, user in enumerate(conversation.users):
        history.append({"role": "user", "content": user})
        for attempt in range(workload.attempts):
            turn = Turn(conversation.tenant, conversation.index, index, attempt, time.monotonic())
            turns.append(turn)
            await chat_turn(session, url, key, model, history, workload.max_tokens, turn)
            if turn.outcome == "completed":
                break
            await asyncio.sleep(workload.retry_pause_s)
        else:
            return
        history.append({"role": "assistant", "content": "".join(turn.reply)})
        await asyncio.sleep(conversation.think_s[index])


async def chat_turn(session: aiohttp.ClientSession, url: str, key: str, model: str, messages: list[dict],
                    max_tokens: int, turn: Turn) -> None:
    """One streamed chat completion, recorded in ``turn`` as it arrives (see ``Turn`` for the outcomes)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with session.post(url + "/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as answer:
            turn.status, turn.backend = answer.status, answer.headers.get("X-Guard-Backend")
            if answer.status != 200:
                turn.outcome, turn.error = "refused", _error_code(await answer.read())
            else:
                await _read_stream(answer, turn)
    except TimeoutError:
        turn.outcome = "timeout"
    except aiohttp.ClientError as exc:
        turn.outcome, turn.error = "truncated", type(exc).__name__
    turn.finished = time.monotonic()


async def _read_stream(answer: aiohttp.ClientResponse, turn: Turn) -> None:
    event = None
    async for raw in answer.content:
        line = raw.rstrip(b"\r\n")
        if not line:
            event = None
        elif line.startswith(b"event:"):
            event = line[6:].strip().decode()
        elif line.startswith(b"data:"):
            data = line[5:].strip()
            if event == "error":
                turn.outcome, turn.error = "stream_error", _error_code(data)
                return
            if data == b"[DONE]":
                turn.outcome = "completed"
                return
            _take_chunk(json.loads(data), turn)
    turn.outcome = "truncated"  # the body ended with neither [DONE] nor an error event


def _take_chunk(chunk: dict, turn: Turn) -> None:
    for choice in chunk.get("choices") or ():
        if text := choice.get("delta", {}).get("content"):
            if turn.first_token is None:
                turn.first_token = time.monotonic()
            turn.reply.append(text)
    if usage := chunk.get("usage"):
        turn.prompt_tokens, turn.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
        turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def backend_counts(turns: Sequence[Turn]) -> Counter[str]:
    """Requests served per replica (``X-Guard-Backend``), counting only the answered ones."""
    return Counter(turn.backend for turn in turns if turn.status == 200 and turn.backend is not None)


def _words(rng: random.Random, count: int) -> str:
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(count))


def _error_code(body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
        return str(error.get("code") or error.get("message"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "unparsable"
