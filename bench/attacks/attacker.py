"""The Fill-and-Squeeze attacker (reference 001): one tenant with an ordinary key and three moves.

1. **Probe.** A tiny streamed request (``probe_max_tokens``, 1..4) every ``probe_interval_s``, from the first
   second of the attack to the last, whatever the answers. The first ``recon_s`` seconds of probes calibrate
   what "room" looks like: their median time to first token (TTFT) and inter-token latency (ITL).
2. **Fill.** While the latest probe answers within ``room_factor`` times those medians (a new request is
   admitted at once, so the pool has free blocks, and the batch is not yet crowded), send one long
   ``ignore_eos`` generation per probe tick, up to ``max_longs`` in flight. Each grows by a token a step
   until the free-block queue is empty.
3. **Squeeze.** The first time a probe says there is no room (slow, refused, or unanswered past the limit),
   start a Poisson stream of micro-requests (``micro_max_tokens`` each) that lasts to the end of the
   attack: at the memory edge each one takes the last free blocks, so the long generations preempt
   and recompute. A long that finishes is replaced as soon as the probes see room again, so the pool is
   kept at its edge.

The attacker never backs off: a refusal (429, 503) is only another "no room" reading.

With several keys (``tenants``), the same attacker spreads each move over them in turn, as colluding API keys
would: every key probes at a fraction of the rate, holds part of the fill and sends part of the squeeze.
``probe_jitter`` draws each probe interval from ``probe_interval_s * (1 +- probe_jitter)``, so that no key's
probes keep a regular beat.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass

import aiohttp

from bench.attacks.client import Outcome, Target, stream_completion

KINDS = ("probe", "long", "micro")


@dataclass(slots=True)
class AttackPlan:
    probe_interval_s: float = 0.25
    probe_max_tokens: int = 2  # two tokens: the gap between them is the ITL reading
    recon_s: float = 2.0
    room_factor: float = 3.0
    room_floor_s: float = 0.05  # limits below this would read scheduling noise on a shared machine as "full"
    long_max_tokens: int = 600
    max_longs: int = 8
    micro_rate: float = 20.0  # per second
    micro_max_tokens: int = 8
    probe_jitter: float = 0.0  # 0..1: each probe interval drawn from probe_interval_s * (1 +- this)


@dataclass(slots=True)
class AttackRequest:
    kind: str  # one of KINDS
    outcome: Outcome


@dataclass(slots=True)
class AttackRecord:
    """What an attack did, as the harness reports it (picklable: it comes back from the attacker's process)."""

    requests: list[AttackRequest]
    fill_start: float | None
    squeeze_start: float | None
    limits: tuple[float, float] | None


def attack(plan: AttackPlan, target: Target, tenants: list[str], seed: int, until: float) -> AttackRecord:
    """Run an attack to ``until`` (``time.monotonic()``, the same clock in every process) in this process,
    with its own event loop and connections: the harness runs it in a process of its own, so that the
    attacker's client work (hundreds of requests, most of them refused at once) never delays the victims'
    clients, whose TTFT would be charged with it."""
    async def run() -> AttackRecord:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            attacker = Attacker(plan, session, target, tenants, seed)
            await attacker.run(until)
            return attacker.record()

    return asyncio.run(run())


class Attacker:
    def __init__(self, plan: AttackPlan, session: aiohttp.ClientSession, target: Target, tenants: list[str],
                 seed: int) -> None:
        self.plan = plan
        self.session = session
        self.target = target
        self.tenants = tenants  # the keys it sends with, each move's requests spread over them in turn
        self._turn = dict.fromkeys(KINDS, 0)
        self.requests: list[AttackRequest] = []
        self.fill_start: float | None = None  # the first long generation sent
        self.squeeze_start: float | None = None  # the first probe that said "no room"
        self.limits: tuple[float, float] | None = None  # (TTFT, ITL) above which there is "no room"
        self._rng = random.Random(seed)
        self._tasks: list[asyncio.Task] = []

    async def run(self, until: float) -> None:
        """Attack until ``until`` (monotonic), then hang up on everything still running."""
        plan = self.plan
        start = tick = time.monotonic()
        try:
            while tick < until:
                self._send("probe", plan.probe_max_tokens, tick)
                if tick >= start + plan.recon_s:
                    if self.limits is None:
                        self.limits = self._calibrate()
                    if self._room(tick):
                        if self._in_flight("long") < plan.max_longs:
                            self.fill_start = self.fill_start or tick
                            self._send("long", plan.long_max_tokens, tick)
                    elif self.squeeze_start is None:
                        self.squeeze_start = tick
                        self._tasks.append(asyncio.create_task(self._squeeze(until)))
                tick += plan.probe_interval_s * (1.0 + plan.probe_jitter * self._rng.uniform(-1.0, 1.0))
                await asyncio.sleep(max(0.0, tick - time.monotonic()))
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def count(self, kind: str) -> int:
        return sum(1 for r in self.requests if r.kind == kind)

    def _send(self, kind: str, max_tokens: int, at: float) -> None:
        request = AttackRequest(kind, Outcome(sent=at))
        self.requests.append(request)
        # Distinct from the first byte: a prefix-cache hit would make the fill cheaper than it should be.
        prompt = {"probe": "ping", "long": "tell me a very long story", "micro": "hi"}[kind]
        body = {"model": "tiny", "prompt": f"{len(self.requests):05d} {prompt}", "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True}
        tenant = self.tenants[self._turn[kind] % len(self.tenants)]
        self._turn[kind] += 1
        self._tasks.append(asyncio.create_task(
            stream_completion(self.session, self.target, tenant, body, request.outcome)))

    def _calibrate(self) -> tuple[float, float]:
        """Room limits from the reconnaissance probes (the floor when none was answered)."""
        probes = [r.outcome for r in self.requests if r.kind == "probe"]
        ttfts = [o.ttft for o in probes if o.ttft is not None]
        itls = [o.itl for o in probes if o.itl is not None]
        floor, factor = self.plan.room_floor_s, self.plan.room_factor
        return (max(floor, factor * statistics.median(ttfts)) if ttfts else floor,
                max(floor, factor * statistics.median(itls)) if itls else floor)

    def _room(self, now: float) -> bool:
        """Does the latest probe reading say that a new request would be admitted at once?"""
        assert self.limits is not None
        ttft_limit, itl_limit = self.limits
        latest: Outcome | None = None
        for request in reversed(self.requests):
            if request.kind != "probe":
                continue
            outcome = request.outcome
            if outcome.first_token is None and outcome.finished is None:
                if now - outcome.sent > ttft_limit:
                    return False  # still waiting past the limit: the loudest "full" there is
                continue
            latest = outcome
            break
        if latest is None or latest.ttft is None:
            return False  # refused, or nothing answered yet
        return latest.ttft <= ttft_limit and (latest.itl is None or latest.itl <= itl_limit)

    def record(self) -> AttackRecord:
        return AttackRecord(self.requests, self.fill_start, self.squeeze_start, self.limits)

    def _in_flight(self, kind: str) -> int:
        return sum(1 for r in self.requests if r.kind == kind and r.outcome.finished is None)

    async def _squeeze(self, until: float) -> None:
        at = time.monotonic()
        while (at := at + self._rng.expovariate(self.plan.micro_rate)) < until:
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            self._send("micro", self.plan.micro_max_tokens, at)
