"""Open-loop tenants: Poisson arrivals of completions, each request's fate recorded as it happens.

Open loop means a slow server does not slow the offered load down: every request is sent at its scheduled
time, however many are still in flight, and its latencies run from that scheduled time, so a lagging
client cannot hide queueing. A tenant reaches the guard with its API key, or the engine directly with the
``X-Tenant-Id`` header the guard would have set.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp


@dataclass(slots=True)
class Result:
    """One request. ``status`` is the HTTP status, 0 for a transport error, None until headers arrive."""

    arrival: float  # scheduled send time (time.monotonic)
    status: int | None = None
    error: str = ""  # the error ``code`` of a non-200 answer, so a report can say why a request failed
    first_token: float | None = None  # streamed requests: the first token event
    finished: float | None = None  # None: still running when the phase was cut
    tokens: int = 0  # completion tokens of a non-streamed answer


@dataclass(slots=True)
class Target:
    """Where the tenants send, and the headers that name each tenant there."""

    name: str
    url: str
    headers: dict[str, dict[str, str]]


def guard_target(url: str, keys: dict[str, str]) -> Target:
    return Target("guard", url, {tenant: {"Authorization": f"Bearer {key}"} for tenant, key in keys.items()})


def engine_target(url: str, tenants: list[str]) -> Target:
    return Target("engine", url, {tenant: {"X-Tenant-Id": tenant} for tenant in tenants})


def error_code(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "unparsable"


async def send(session: aiohttp.ClientSession, target: Target, tenant: str, body: dict,
               result: Result) -> None:
    """POST one completion and record what came back: the first token event of a stream, or the usage of a
    non-streamed answer."""
    try:
        headers = target.headers[tenant]
        async with session.post(target.url + "/v1/completions", json=body, headers=headers) as answer:
            result.status = answer.status
            if answer.status != 200:
                result.error = error_code(await answer.read())
            elif body.get("stream"):
                async for line in answer.content:
                    if result.first_token is None and line.startswith(b"data:") \
                            and line[5:].strip() != b"[DONE]":
                        result.first_token = time.monotonic()
            else:
                result.tokens = json.loads(await answer.read())["usage"]["completion_tokens"]
    except aiohttp.ClientError:
        result.status = 0
    result.finished = time.monotonic()


async def arrivals(rate: float, seed: int, start: float, duration: float,
                   fire: Callable[[Result], Awaitable[None]], results: list[Result],
                   on_off: tuple[float, float] | None = None) -> list[asyncio.Task]:
    """Poisson arrivals at ``rate`` per second over ``duration`` seconds from ``start``, each a task;
    the same ``seed`` gives the same arrival times. ``on_off`` = (on, off) seconds: the arrivals come in
    bursts of ``on`` seconds ``off`` seconds apart, at ``rate * (on + off) / on`` within a burst (the same
    mean rate)."""
    rng = random.Random(seed)
    burst_rate, into_bursts = rate, lambda busy: busy  # without bursts, exactly the plain Poisson times
    if on_off is not None:
        on, off = on_off
        burst_rate, into_bursts = rate * (on + off) / on, lambda busy: busy // on * (on + off) + busy % on
    tasks, busy = [], 0.0  # ``busy``: seconds of bursts before the next arrival
    while True:
        busy += rng.expovariate(burst_rate)
        at = start + into_bursts(busy)
        if at >= start + duration:
            break
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        result = Result(arrival=at)
        results.append(result)
        tasks.append(asyncio.create_task(fire(result)))
    return tasks


def status_counts(results: list[Result]) -> dict[str, int]:
    """``{"200": n, "429 queue_full": n, "unfinished": n, ...}``: every request in exactly one bucket."""
    return dict(Counter("unfinished" if r.finished is None else f"{r.status} {r.error}".strip()
                        for r in results))
