"""One streamed completion as a benchmark client sees it: status, first and second token, end.

Every request in the attack harness, a victim's or the attacker's, is streamed, so that its time to first
token is what a user would see and a probe's second token gives the inter-token latency the attacker reads.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import aiohttp


@dataclass(slots=True)
class Target:
    """Where the tenants send and the headers that name each of them there."""

    name: str  # "engine" or "guard"
    url: str
    headers: dict[str, dict[str, str]]  # tenant -> headers


def engine_target(url: str, tenants: list[str]) -> Target:
    """Straight to the engine, which trusts ``X-Tenant-Id`` for its per-tenant accounting."""
    return Target("engine", url, {t: {"X-Tenant-Id": t} for t in tenants})


def guard_target(url: str, keys: dict[str, str]) -> Target:
    """Through the guard, which learns the tenant from the API key alone."""
    return Target("guard", url, {t: {"Authorization": f"Bearer {key}"} for t, key in keys.items()})


@dataclass(slots=True)
class Outcome:
    """One request. ``status`` is the HTTP status, 0 for a transport error, None until headers arrive;
    times are ``time.monotonic()``; ``sent`` is the scheduled send time, so client lag is charged too."""

    sent: float
    status: int | None = None
    error: str = ""  # the OpenAI error ``code`` of a refusal (``abuse_suspected``, ``queue_full``, ...)
    first_token: float | None = None
    second_token: float | None = None
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def itl(self) -> float | None:
        if self.first_token is None or self.second_token is None:
            return None
        return self.second_token - self.first_token

    @property
    def label(self) -> str:
        """``"200"``, ``"429 abuse_suspected"``, ``"0"`` (transport error) or ``"unfinished"``."""
        return "unfinished" if self.finished is None else f"{self.status} {self.error}".strip()


async def stream_completion(session: aiohttp.ClientSession, target: Target, tenant: str, body: dict,
                            outcome: Outcome) -> None:
    """POST ``body`` (streamed) as ``tenant`` and fill ``outcome`` in as the answer arrives.

    Cancelling the task closes the connection, which aborts the request in the guard and the engine.
    """
    try:
        async with session.post(target.url + "/v1/completions", json={**body, "stream": True},
                                headers=target.headers[tenant]) as answer:
            outcome.status = answer.status
            if answer.status != 200:
                outcome.error = _error_code(await answer.read())
            event = b""
            async for line in answer.content:
                if line.startswith(b"event:"):
                    event = line[6:].strip()
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                if event == b"error":  # the event that ends a stream cut short (a revoked one: the reason)
                    outcome.error = _error_code(line[5:])
                    continue
                now = time.monotonic()
                if outcome.first_token is None:
                    outcome.first_token = now
                elif outcome.second_token is None:
                    outcome.second_token = now
    except aiohttp.ClientError:
        outcome.status = 0
    outcome.finished = time.monotonic()


def _error_code(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "unparsable"
