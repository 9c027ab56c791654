"""One guard's link to the state it shares with the other guards (``shared_state: {redis_url}``).

Each decision is one atomic Lua script in Redis (guard/state/scripts.py), run through redis-py's asyncio
client. The link keeps the guard's lease: a background task renews it every ``lease_ttl_s / 5``; a guard
whose lease lapses (it died, or lost Redis for longer than the TTL) is dead to the others, and the first
script that meets it removes what it held, so its reservations are gone within the TTL and nothing it
reserved drifts forever.

Redis down: a call that fails or takes longer than ``timeout_s`` marks the link down (``up`` False,
``guard_shared_state_up`` 0) and the caller decides alone, conservatively: ``live_guards`` keeps the number
of guards last seen, and each guard then commits at most its share of each engine (guard/admission/gate.py,
``share``). The renewal task keeps trying; when Redis answers again the guard writes its own ledger and
backlog back (``resync``: what Redis lost, or what the others expired while it was away) and the link is up.
A guard that starts does the same, so a restarted guard rejoins without anyone's help.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from guard.config import SharedState as SharedStateConfig
from guard.metrics import GuardMetrics
from guard.state import scripts

log = logging.getLogger("guard.state.shared")

OUTBOX_BATCH = 256  # sends per pipelined round trip at most

# What the guard holds, as it knows it: ({engine: (reserved, borrowed)}, {tenant: queued}).
Holdings = tuple[dict[str, tuple[int, int]], dict[str, int]]


class SharedState:
    def __init__(self, config: SharedStateConfig, metrics: GuardMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.guard_id = uuid.uuid4().hex[:12]
        self.client = aioredis.Redis.from_url(config.redis_url, socket_timeout=config.timeout_s,
                                              socket_connect_timeout=config.timeout_s)
        self._scripts = {name: self.client.register_script(getattr(scripts, name)) for name in (
            "ADMIT", "RELEASE", "BACKLOG", "RESYNC", "RENEW", "VERDICTS", "RATE_CHARGE", "RATE_SETTLE")}
        self.up = False
        self.live_guards = 1  # the last number seen: each guard's share while Redis is down
        self.holdings: Callable[[], Holdings] = lambda: ({}, {})  # set by the dispatcher
        self.on_change: Callable[[bool], None] = lambda up: None  # told when the link goes up or down
        # Updates nobody waits for (releases, backlog changes), sent in order by one task: a tenant's -1
        # must never overtake its +1. Dropped while Redis is down: the resync that follows covers them.
        self._outbox: asyncio.Queue[tuple[str, tuple[Any, ...]] | None] = asyncio.Queue()  # None: stop
        # Set by ``stop``: every loop of the link ends at its next turn. Cancelling them alone is not enough:
        # a cancellation that arrives inside a Redis call may be absorbed there (seen with redis-py 8: the
        # outbox task went back to waiting and the guard's clean-up waited for it forever).
        self.stopping = False
        metrics.shared_up.set(0)

    async def call(self, name: str, *args: Any) -> Any | None:
        """Run script ``name`` with ``args``; None when Redis did not answer (the link is then down)."""
        if not self.up:
            return None
        started = time.perf_counter()
        try:
            result = await self._scripts[name](keys=scripts.KEYS, args=[self.guard_id, *args])
        except (RedisError, OSError, TimeoutError) as exc:
            self._set_up(False, exc)
            return None
        self.metrics.shared_round_trip.labels(name.lower()).observe(time.perf_counter() - started)
        return result

    def send(self, name: str, *args: Any) -> None:
        """Run script ``name`` later, in order with the other sends, without waiting for it."""
        if self.up:
            self._outbox.put_nowait((name, args))

    async def deliver(self) -> None:
        """The outbox's one sender (runs for the guard's lifetime): what queued while the last batch was on
        its way goes in one pipelined round trip, in order, so a busy guard pays one trip for many sends."""
        stopping = False
        while not stopping and (item := await self._outbox.get()) is not None:
            batch = [item]
            while not self._outbox.empty() and len(batch) < OUTBOX_BATCH:
                if (more := self._outbox.get_nowait()) is None:
                    stopping = True
                    break
                batch.append(more)
            if len(batch) == 1:
                await self.call(batch[0][0], *batch[0][1])
            elif self.up:
                await self._pipelined(batch)

    async def _pipelined(self, batch: list[tuple[str, tuple[Any, ...]]]) -> None:
        started = time.perf_counter()
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for name, args in batch:
                    await self._scripts[name](keys=scripts.KEYS, args=[self.guard_id, *args], client=pipe)
                await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            self._set_up(False, exc)
            return
        self.metrics.shared_round_trip.labels("batch").observe(time.perf_counter() - started)

    async def run(self) -> None:
        """Keep the lease (and so everything this guard holds) alive; bring the link back after a failure."""
        period = self.config.lease_ttl_s / 5
        while not self.stopping:
            if self.up:
                renewed = await self.call("RENEW", self.config.lease_ttl_s)
                if renewed is not None:
                    self._live(int(renewed[0]))
                    if not renewed[1]:  # Redis lost us (restarted empty), or our lease lapsed meanwhile
                        await self.resync()
            else:
                await self.resync()
            await asyncio.sleep(period if self.up else min(period, 1.0))

    async def resync(self) -> bool:
        """Write this guard's own ledger and backlog into Redis, replacing what it holds there; up on success.

        The holdings are read and sent with no await between, so no decision of this guard falls between
        them; admissions made while the call is in flight are local (the link is not up yet)."""
        while not self._outbox.empty():  # what they would send, the holdings below already say
            self._outbox.get_nowait()
        ledger, backlog = self.holdings()
        args: list[Any] = [self.config.lease_ttl_s]
        for engine, (reserved, borrowed) in ledger.items():
            args += ["ledger", f"{engine}|r", reserved, "ledger", f"{engine}|b", borrowed]
        for tenant, queued in backlog.items():
            args += ["backlog", tenant, queued]
        started = time.perf_counter()
        try:
            guards = await self._scripts["RESYNC"](keys=scripts.KEYS, args=[self.guard_id, *args])
        except (RedisError, OSError, TimeoutError) as exc:
            self._set_up(False, exc)
            return False
        self.metrics.shared_round_trip.labels("resync").observe(time.perf_counter() - started)
        self._live(int(guards))
        self._set_up(True)
        return True

    def _live(self, guards: int) -> None:
        self.live_guards = max(1, guards)
        self.metrics.shared_guards.set(self.live_guards)

    def _set_up(self, up: bool, exc: BaseException | None = None) -> None:
        if up == self.up:
            return
        self.up = up
        if not up:
            while not self._outbox.empty():
                self._outbox.get_nowait()
        self.metrics.shared_up.set(1 if up else 0)
        if up:
            log.warning("shared state: Redis is back; guard %s resynchronised (%d guards live)", self.guard_id,
                        self.live_guards)
        else:
            log.error("shared state: Redis unavailable (%s: %s); admitting alone, to 1/%d of each engine",
                      type(exc).__name__, exc, self.live_guards)
        self.on_change(up)

    def stop(self) -> None:
        """End the link's loops (the guard is shutting down); ``close`` once they have ended."""
        self.stopping = True
        self._outbox.put_nowait(None)

    async def close(self) -> None:
        await self.client.aclose()

