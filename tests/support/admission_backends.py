"""One admission core over its two state backends, driven the same way: ``admission(backend, ...)`` gives
guards whose dispatchers decide in the process (``"local"``) or through a real Redis (``"redis"``, the
ledger of guard/state/ledger.py, with the link's wire and lease running), in front of the same replicas on
real gates; ``Script`` drives arrivals, first tokens and completions through one of them and writes down
every decision, so that two backends' decisions can be compared whole.

Time is a ``FakeClock`` in the modules that decide (dispatch, SLO judgement, latency models, gates, the
pool), advanced only by the script: the two backends are then judged at the same instants, and what a
decision depends on (queue pace, predicted waits, telemetry age) is the same for both. The link to Redis
keeps the real clock (its leases are Redis's).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import types
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis as redis_client

import guard.admission.dispatch
import guard.admission.fairness
import guard.admission.slo
import guard.pool.gate
import guard.pool.pool
import guard.pool.replica
from guard.admission import slo
from guard.admission.dispatch import Dispatcher
from guard.admission.ticket import Ticket, TicketState
from guard.config import Admission, GuardConfig, load_config
from guard.config import SharedState as SharedStateConfig
from guard.errors import GuardError
from guard.metrics import GuardMetrics
from guard.pool.gate import AdmissionGate
from guard.pool.pool import ReplicaPool
from guard.pool.replica import Replica
from guard.pool.routing import CircuitBreaker
from guard.pool.scheduling import profile_for
from guard.state.ledger import RedisLedger
from guard.state.shared import SharedState

from .admission_parts import BASE, snapshot, write
from .redis_server import RedisServer

BACKENDS = ("local", "redis")
CLOCKED = (guard.admission.dispatch, guard.admission.fairness, guard.admission.slo, guard.pool.gate,
           guard.pool.pool, guard.pool.replica)


class FakeClock:
    """``time.monotonic`` for the modules that decide, advanced by hand; the rest of ``time`` as it is."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import time

        fake = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
        fake.monotonic = self.monotonic
        for module in CLOCKED:
            monkeypatch.setattr(module, "time", fake)


def pool(config: GuardConfig, num_blocks: Iterable[int]) -> ReplicaPool:
    """The config's replicas on real gates, idle, with telemetry that never goes stale on the fake clock."""
    admission = Admission(safe_utilization=config.admission.safe_utilization, telemetry_stale_s=1e9)
    replicas = []
    for backend, blocks in zip(config.pool, num_blocks, strict=True):
        gate = AdmissionGate(admission, {t.name for t in config.tenants})
        gate.update(snapshot(num_blocks=blocks, free=blocks))
        replicas.append(Replica(backend, gate, CircuitBreaker(backend.name, 3, 1.0)))
    return ReplicaPool(replicas)


@contextlib.asynccontextmanager
async def admission(backend: str, config: GuardConfig, num_blocks: Iterable[int], redis_url: str | None = None,
                    guards: int = 1) -> AsyncIterator[list[Dispatcher]]:
    """``guards`` dispatchers on ``backend``, each over its own view of the same replicas (``num_blocks``
    each); on Redis they share one ledger, every link up before the first decision."""
    blocks = list(num_blocks)
    if backend == "local":
        assert guards == 1, "guards alone share nothing"
        yield [Dispatcher(config, pool(config, blocks), profile_for(config.routing))]
        return
    assert backend == "redis" and redis_url is not None
    links, dispatchers, tasks = [], [], []
    for _ in range(guards):
        link = SharedState(SharedStateConfig(redis_url=redis_url, lease_ttl_s=15.0, timeout_s=2.0), GuardMetrics())
        replicas = pool(config, blocks)
        dispatcher = Dispatcher(config, replicas, profile_for(config.routing), RedisLedger(link, replicas))
        links.append(link)
        dispatchers.append(dispatcher)
        tasks += [asyncio.create_task(link.deliver()), asyncio.create_task(dispatcher.run())]
        assert await link.resync()
    for link in links:  # each sees every guard, as its lease renewal would tell it
        await link.renew()
        assert link.up and link.live_guards == guards
    try:
        yield dispatchers
    finally:
        for link, dispatcher in zip(links, dispatchers, strict=True):
            link.stop()
            dispatcher.stop()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
        for link in links:
            await link.close()


@contextlib.asynccontextmanager
async def one_replica(backend: str, tmp_path: Path, redis: RedisServer, num_blocks: int = 100
                      ) -> AsyncIterator[tuple[Dispatcher, GuardConfig]]:
    """``admission_parts.make_dispatcher``'s dispatcher and config (one replica, acme weight 2 with
    ``max_queue`` 3, bulk weight 1), on ``backend`` (Redis emptied first)."""
    config = load_config(write(tmp_path, BASE.replace("{name: acme,", "{name: acme, max_queue: 3,")))
    if backend == "redis":
        flush(redis)
    async with admission(backend, config, [num_blocks], redis.url) as (dispatcher,):
        yield dispatcher, config


def flush(redis: RedisServer) -> None:
    """Redis as it starts: nothing held, no guard known (between tests that share one server)."""
    with redis_client.Redis.from_url(redis.url) as client:
        client.flushall()


@dataclass
class Script:
    """Arrivals and ends driven through ``dispatcher`` on ``clock``, every decision written down in
    ``decisions`` as (request, what became of it, the replica, blocks borrowed): the record two backends
    are compared by."""

    dispatcher: Dispatcher
    clock: FakeClock
    decisions: list[tuple] = field(default_factory=list)
    tickets: dict[str, Ticket] = field(default_factory=dict)
    waiting: dict[str, asyncio.Task] = field(default_factory=dict)
    ids: itertools.count = field(default_factory=itertools.count)

    async def arrive(self, tenant: int, blocks: int, prompt_tokens: int = 64, max_tokens: int = 32,
                     priority_class: str = "", headers: Mapping[str, str] | None = None) -> str:
        """A request of ``config.tenants[tenant]`` in its lane, of ``priority_class`` ("": its lane's), with
        ``headers`` (its ``X-SLO-*`` tighten its objective)."""
        config = self.dispatcher.config
        who = config.tenants[tenant]
        lane = config.lanes[who.lane]
        rid = f"r{next(self.ids)}"
        selected = (priority_class or lane.priority_class, None, lane.slo)
        ticket = Ticket(rid, who, lane, prompt_tokens, max_tokens, blocks, arrived=self.clock.now,
                        objective=slo.objective_for(lane, headers or {}, selected), priority_class=priority_class)
        self.tickets[rid] = ticket
        self.waiting[rid] = asyncio.create_task(self.dispatcher.submit(ticket))
        await self.settle()
        return rid

    async def first_token(self, rid: str, after_s: float) -> None:
        """The request's first token, ``after_s`` after its admission: its replica's latency model learns it."""
        self.dispatcher.started(self.tickets[rid], after_s)
        await self.settle()

    async def end(self, rid: str, output_tokens: int) -> None:
        ticket = self.tickets[rid]
        self.dispatcher.charge_output(ticket, output_tokens)
        self.dispatcher.finish(ticket)
        self.decisions.append((rid, "ended"))
        await self.settle()

    def tick(self, seconds: float) -> None:
        self.clock.now += seconds

    def running(self) -> list[str]:
        return [rid for rid, t in self.tickets.items() if t.state is TicketState.ADMITTED]

    async def settle(self) -> None:
        """Until every decision the last step set off is made: each waiting submit has returned or raised,
        or its ticket is queued with the admission round idle (on Redis: the wire empty, no round running)."""
        for _ in range(400):
            await asyncio.sleep(0)
            ledger = self.dispatcher.ledger
            busy = ledger is not None and (self.dispatcher._in_round or not ledger.shared._wire.empty()
                                           or ledger.shared._sending.locked())
            pending = [rid for rid, task in self.waiting.items()
                       if not task.done() and self.tickets[rid].state is not TicketState.QUEUED]
            if not busy and not pending:
                await asyncio.sleep(0.01 if ledger is not None else 0)  # a retry round that was due
                if not (ledger is not None and self.dispatcher._in_round):
                    break
            else:
                await asyncio.sleep(0.002)
        for rid, task in list(self.waiting.items()):
            if task.done():
                del self.waiting[rid]
                ticket = self.tickets[rid]
                if (exc := task.exception()) is not None:
                    assert isinstance(exc, GuardError), exc
                    self.decisions.append((rid, exc.code))
                else:
                    self.decisions.append((rid, "admitted", ticket.replica.name if ticket.replica else None,
                                           ticket.borrowed))

    async def close(self) -> None:
        for task in self.waiting.values():
            task.cancel()
        await asyncio.gather(*self.waiting.values(), return_exceptions=True)
