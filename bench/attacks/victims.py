"""Victim tenants: steady, open-loop Poisson interactive traffic, every request streamed.

Open loop: arrivals follow a seeded schedule whatever the server does, so a slow server cannot slow the
offered load down, and each run replays exactly the same arrival times. A victim's TTFT runs from its
scheduled arrival to its first token.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import aiohttp

from bench.attacks.client import Outcome, Target, stream_completion


@dataclass(slots=True)
class VictimLoad:
    tenants: tuple[str, ...]
    rate: float  # requests per second, per tenant
    max_tokens: int


@dataclass(slots=True)
class VictimRequest:
    tenant: str
    outcome: Outcome


async def victim_traffic(session: aiohttp.ClientSession, target: Target, load: VictimLoad, seed: int,
                         start: float, end: float, requests: list[VictimRequest]) -> list[asyncio.Task]:
    """Every victim's arrivals from ``start`` to ``end``, each request a task (appended to ``requests``)."""
    schedule = sorted((at, tenant) for index, tenant in enumerate(load.tenants)
                      for at in _poisson(random.Random(seed * 1000 + index), load.rate, start, end))
    tasks = []
    for at, tenant in schedule:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        request = VictimRequest(tenant, Outcome(sent=at))
        requests.append(request)
        # Distinct from the first byte, so no request reuses another's prefix-cache blocks.
        body = {"model": "tiny", "prompt": f"{len(requests):05d} {tenant}: how do I reset my password?",
                "max_tokens": load.max_tokens, "temperature": 0.0, "ignore_eos": True}
        tasks.append(asyncio.create_task(stream_completion(session, target, tenant, body, request.outcome)))
    return tasks


def _poisson(rng: random.Random, rate: float, start: float, end: float) -> list[float]:
    times, at = [], start
    while (at := at + rng.expovariate(rate)) < end:
        times.append(at)
    return times
