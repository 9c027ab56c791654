"""One guard's link to the state it shares with the other guards (``shared_state: {redis_url}``).

Each decision is one atomic Lua script in Redis (guard/state/scripts.py), run through redis-py's asyncio
client. What requests send (``ask`` a decision and wait for it, ``send`` an update and go on) goes out in
order on one wire: a single task sends everything queued while its previous round trip was on its way as one
``BATCH`` script, so under load a round trip carries many requests' ops and its cost is shared between them
(one op per trip when idle: nothing waits to fill a batch). The link keeps the guard's lease: a background
task renews it every ``lease_ttl_s / 5``; a guard whose lease lapses (it died, or lost Redis for longer than
the TTL) is dead to the others, and the first script that meets it removes what it held, so its reservations
are gone within the TTL and nothing it reserved drifts forever.

Redis down or slow: a call that fails or takes longer than ``timeout_s`` (the deadline, 0.25 s by default)
marks the link down (``up`` False, ``guard_shared_state_up`` 0) and the caller decides alone, conservatively:
``live_guards`` keeps the number of guards last seen, and each guard then commits at most its share of each
engine, less what the others held beyond theirs as the ledger showed it (guard/pool/gate.py, ``share`` and
``others``: their peak over the last second of answers and renewals, guard/state/sightings.py; what they were
granted in the last 0.2 s before the outage beyond that is not seen, the one over-commit left). No request waits longer than the
deadline for a decision: the round trip that passes it is given up, and its ops are decided locally. The
renewal task keeps trying; when Redis answers again the guard writes its own ledger and backlog back
(``resync``: what Redis lost, or what the others expired while it was away) and the link is up. A guard that
starts does the same, so a restarted guard rejoins without anyone's help.

Coming back, nothing is counted twice or missed:

- each resync starts a new *epoch* (scripts.py): a batch of an older epoch (one that timed out and ran in
  Redis late) or one sent into a Redis that lost this guard is refused whole, the link goes down, and the
  guard resyncs before deciding anything through the ledger again;
- the link is up again only once as many guards have resynced as were live before the outage
  (``live_guards``), or ``lease_ttl_s`` after this guard's own return (a guard that died meanwhile never
  comes back): until the others have written their holdings, a ledger without them would let this guard
  admit into blocks they hold. Meanwhile it stays conservative, writes its holdings again at each try, and
  is marked alone in Redis, so that a guard already back counts it at its share at least.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from guard.config import SharedState as SharedStateConfig
from guard.metrics import GuardMetrics
from guard.state import scripts

log = logging.getLogger("guard.state.shared")

WIRE_BATCH = 256  # ops per round trip at most
RENEW_S = 0.2  # the lease is renewed at least this often (and what the others hold learned with it)
RETRY_S = 1.0  # while the link is down, how often a resync is tried


class StaleEpoch(Exception):
    """Redis answered, but no longer knows this guard as it last wrote itself there."""


class _Op(NamedTuple):
    """One op on the wire: ``answer`` is None for an update nobody waits for."""

    name: str
    args: tuple[Any, ...]
    answer: asyncio.Future[Any] | None
    on_answer: Callable[[Any], None] | None  # called with the answer as it arrives, before anyone awaits it
    queued_at: float  # perf_counter


HELD = ("RELEASE", "BACKLOG")  # the updates whose effect a guard's holdings carry (and a resync rewrites)


# What the guard holds, as it knows it: ({engine: (reserved, borrowed)}, {tenant: queued}).
Holdings = tuple[dict[str, tuple[int, int]], dict[str, int]]


class SharedState:
    def __init__(self, config: SharedStateConfig, metrics: GuardMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.guard_id = uuid.uuid4().hex[:12]
        self.client = aioredis.Redis.from_url(config.redis_url, socket_timeout=config.timeout_s,
                                              socket_connect_timeout=config.timeout_s)
        self._scripts = {name: self.client.register_script(getattr(scripts, name))
                         for name in ("BATCH", "RESYNC", "RENEW", "VERDICTS")}
        self.up = False
        self.live_guards = 1  # the last number seen: each guard's share while Redis is down
        self.epoch = 0  # of this guard's last resync: Redis refuses batches of any other (see the docstring)
        self.rejoined_at: float | None = None  # monotonic: when Redis first answered a resync after an outage
        self.holdings: Callable[[], Holdings] = lambda: ({}, {})  # set by the dispatcher
        self.on_change: Callable[[bool], None] = lambda up: None  # told when the link goes up or down
        # Told what the other guards hold, {engine: [blocks per guard]}, as the ledger says it.
        self.on_others: Callable[[dict[str, dict[str, int]]], None] = lambda others: None
        # The ops requests send, in order: a tenant's backlog -1 must never overtake its +1, and a release
        # sent before an admission frees its blocks first. Dropped while Redis is down (a decision's answer
        # is then None): the resync that follows covers the updates.
        self._wire: asyncio.Queue[_Op | None] = asyncio.Queue()  # None: stop
        self._sending = asyncio.Lock()  # held by a round trip of the wire, and by a resync: never both at once
        self._timers = {name: metrics.shared_round_trip.labels(name.lower()) for name in scripts.OPS}
        # Set by ``stop``: every loop of the link ends at its next turn. Cancelling them alone is not enough:
        # a cancellation that arrives inside a Redis call may be absorbed there (seen with redis-py 8: the
        # sending task went back to waiting and the guard's clean-up waited for it forever).
        self.stopping = False
        metrics.shared_up.set(0)

    async def call(self, name: str, *args: Any) -> Any | None:
        """Run script ``name`` (the lease's and the verdicts') with ``args`` in a round trip of its own; None
        when Redis did not answer (the link is then down)."""
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

    def ask(self, name: str, *args: Any, on_answer: Callable[[Any], None] | None = None) -> asyncio.Future[Any]:
        """Decision ``name`` (one of ``scripts.OPS``) on the wire; the future's result is its answer, or None
        when Redis did not answer (at once while the link is down). ``on_answer`` gets the answer the moment
        it arrives: what it records there is in the holdings of any resync that follows. Cancelling the
        future does not take the op back: a caller that may leave shields it and undoes what was granted."""
        answer = asyncio.get_running_loop().create_future()
        if self.up:
            self._wire.put_nowait(_Op(name, args, answer, on_answer, time.perf_counter()))
        else:
            answer.set_result(None)
        return answer

    def send(self, name: str, *args: Any) -> None:
        """Update ``name`` (one of ``scripts.OPS``) on the wire, in order with the others; nobody waits."""
        if self.up:
            self._wire.put_nowait(_Op(name, args, None, None, time.perf_counter()))

    async def deliver(self) -> None:
        """The wire's one sender (runs for the guard's lifetime): what queued while the last round trip was on
        its way goes in the next, in order."""
        stopping = False
        while not stopping and (op := await self._wire.get()) is not None:
            await asyncio.sleep(0)  # one turn of the loop: what the requests ready now ask goes in this trip
            batch = [op]
            while not self._wire.empty() and len(batch) < WIRE_BATCH:
                if (more := self._wire.get_nowait()) is None:
                    stopping = True
                    break
                batch.append(more)
            await self._trip(batch)

    async def _trip(self, batch: list[_Op]) -> None:
        """One ``BATCH`` round trip; every op's answer goes to its future (None for all when it failed)."""
        ops = json.dumps([(op.name, op.args) for op in batch], separators=(",", ":"))
        answers: list[Any] = [None] * len(batch)
        async with self._sending:
            if self.up:
                started = time.perf_counter()
                try:
                    answered = json.loads(await self._scripts["BATCH"](keys=scripts.KEYS,
                                                                       args=[self.guard_id, self.epoch, ops]))
                    if answered == "stale":
                        raise StaleEpoch(f"Redis does not know guard {self.guard_id} at epoch {self.epoch}")
                    answers = answered
                except (RedisError, OSError, TimeoutError, StaleEpoch) as exc:
                    self._set_up(False, exc)
                else:
                    done = time.perf_counter()
                    self.metrics.shared_round_trip.labels("batch").observe(done - started)
                    for op in batch:
                        self._timers[op.name].observe(done - op.queued_at)
            for op, answer in zip(batch, answers, strict=True):
                self._answer(op, answer)

    async def run(self) -> None:
        """Keep the lease (and so everything this guard holds) alive; bring the link back after a failure."""
        # Each renewal also says what the others hold: what a guard keeps clear of if Redis then goes away.
        period = min(self.config.lease_ttl_s / 5, RENEW_S)
        while not self.stopping:
            if self.up:
                await self.renew()
            if not self.up:
                await self.resync()
            await asyncio.sleep(period if self.up else min(period, RETRY_S))

    async def renew(self) -> None:
        """Renew the lease, and learn the live guards and what the others hold. A Redis that no longer knows
        this guard at its epoch (restarted empty, or the lease lapsed meanwhile) takes the link down: the
        guard is conservative until its resync."""
        renewed = await self.call("RENEW", self.config.lease_ttl_s, self.epoch)
        if renewed is None:
            return
        if not renewed[1]:  # its count and ledger may lack guards that have not resynced yet either
            self._set_up(False, StaleEpoch(f"Redis no longer knows guard {self.guard_id}"))
            return
        self._live(int(renewed[0]))
        self.on_others(json.loads(renewed[2]) or {})  # cjson writes an empty table as {}

    async def resync(self) -> bool:
        """Write this guard's own ledger and backlog into Redis, replacing what it holds there; up on success.

        No round trip of the wire is on its way meanwhile, and every answer of the last one was recorded as it
        arrived (``on_answer``), so the holdings hold every grant Redis made this guard; decisions asked
        meanwhile wait on the wire and go after. Down, admissions made while the call is in flight are local
        (the link is not up yet)."""
        async with self._sending:
            return await self._resync()

    async def _resync(self) -> bool:
        self._drop_wire(held_only=True)  # what they would change, the holdings below already say
        ledger, backlog = self.holdings()
        self.epoch += 1  # each try a new one: a try that times out and runs late leaves a stale epoch behind
        now = time.monotonic()
        waiting = self.rejoined_at is None or now - self.rejoined_at < self.config.lease_ttl_s
        expected = self.live_guards if waiting else 0  # past the wait, a guard that never came back is gone
        args: list[Any] = [self.config.lease_ttl_s, self.epoch, expected]
        for engine, (reserved, borrowed) in ledger.items():
            args += ["ledger", f"{engine}|r", reserved, "ledger", f"{engine}|b", borrowed]
        for tenant, queued in backlog.items():
            args += ["backlog", tenant, queued]
        started = time.perf_counter()
        try:
            guards = await self._scripts["RESYNC"](keys=scripts.KEYS, args=[self.guard_id, *args])
        except (RedisError, OSError, TimeoutError) as exc:
            self._set_up(False, exc)
            self.rejoined_at = None
            return False
        self.metrics.shared_round_trip.labels("resync").observe(time.perf_counter() - started)
        if self.rejoined_at is None:
            self.rejoined_at = now
        if int(guards) < expected:  # the others have not written theirs back yet: still alone, conservatively
            return False
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
        self.rejoined_at = None
        if not up:
            self._drop_wire(held_only=False)
            self.metrics.shared_lost.labels(_reason(exc)).inc()
        self.metrics.shared_up.set(1 if up else 0)
        if up:
            log.warning("shared state: Redis is back; guard %s resynchronised (%d guards live)", self.guard_id,
                        self.live_guards)
        else:
            log.error("shared state: Redis unavailable (%s: %s); admitting alone, to 1/%d of each engine",
                      type(exc).__name__, exc, self.live_guards)
        self.on_change(up)

    def _drop_wire(self, held_only: bool) -> None:
        """Take the ops waiting on the wire off it (decisions answered None); with ``held_only``, only the
        updates the holdings carry: the rest stay, in order."""
        kept: list[_Op | None] = []
        while not self._wire.empty():
            op = self._wire.get_nowait()
            if op is None or (held_only and op.name not in HELD):
                kept.append(op)  # None: stopping, the sender's cue
            else:
                self._answer(op, None)
        for op in kept:
            self._wire.put_nowait(op)

    @staticmethod
    def _answer(op: _Op, answer: Any) -> None:
        if op.on_answer is not None:
            op.on_answer(answer)
        if op.answer is not None and not op.answer.done():
            op.answer.set_result(answer)

    def stop(self) -> None:
        """End the link's loops (the guard is shutting down); ``close`` once they have ended."""
        self.stopping = True
        self._wire.put_nowait(None)

    async def close(self) -> None:
        await self.client.aclose()


def _reason(exc: BaseException | None) -> str:
    """Why the link went down, as ``guard_shared_state_lost_total`` counts it."""
    if isinstance(exc, StaleEpoch):
        return "stale"
    return "timeout" if isinstance(exc, (TimeoutError, RedisTimeoutError)) else "error"
