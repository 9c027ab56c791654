"""The link's wire to a real Redis: what requests ask and send travels in batches, in order, one atomic script
per round trip; a lapsed lease is found by the next batch or renewal and rewritten; a client that leaves while
the ledger decides leaves nothing reserved."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config
from support.redis_server import RedisServer
from support.wait import wait_for

from guard.admission.ticket import Ticket
from guard.config import SharedState as SharedStateConfig
from guard.metrics import GuardMetrics
from guard.state import scripts
from guard.state.shared import SharedState

# Keeps Redis busy (it runs one script at a time) for a few hundred milliseconds.
BUSY_LUA = "local i = 0 while i < 20000000 do i = i + 1 end return i"


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path) as server:
        yield server


@contextlib.asynccontextmanager
async def link(url: str, lease_ttl_s: float = 10.0, timeout_s: float = 0.5,
               run: bool = False) -> AsyncIterator[SharedState]:
    """One guard's link, up, with its wire delivered (and its lease kept, with ``run``)."""
    shared = SharedState(SharedStateConfig(redis_url=url, lease_ttl_s=lease_ttl_s, timeout_s=timeout_s),
                         GuardMetrics())
    shared.on_change = lambda up: None
    tasks = [asyncio.create_task(shared.deliver())]
    assert await shared.resync()
    if run:
        tasks.append(asyncio.create_task(shared.run()))
    try:
        yield shared
    finally:
        shared.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        await shared.close()


def count(shared: SharedState, op: str) -> int:
    value = shared.metrics.registry.get_sample_value("guard_shared_state_round_trip_seconds_count", {"op": op})
    return int(value or 0)


def admit(shared: SharedState, blocks: int, room: int,
          on_answer: Callable[[Any], None] | None = None) -> asyncio.Future:
    return shared.ask("ADMIT", "e", "t", blocks, 0, room, room, 1.0, 64.0, on_answer=on_answer)


async def ledger(url: str) -> dict[str, int]:
    """The shared ledger's fields that hold blocks (not the guards' epochs, marks and last renewals)."""
    async with aioredis.Redis.from_url(url, decode_responses=True) as client:
        return {field: int(value) for field, value in (await client.hgetall(scripts.KEYS[1])).items()
                if field.endswith(("|r", "|b")) and int(value)}


async def test_concurrent_decisions_share_round_trips_in_the_order_asked(redis: RedisServer) -> None:
    async with link(redis.url) as shared:
        answers = await asyncio.gather(*(admit(shared, 1, 10) for _ in range(40)))
        assert [answer[0] for answer in answers] == [1] * 10 + [0] * 30, "the first ten asked fill the room"
        assert {answer[1] for answer in answers[10:]} == {"full"}
        assert await ledger(redis.url) == {f"{shared.guard_id}|e|r": 10}
        for _ in range(10):
            shared.send("RELEASE", "e", 1, 0, "t", 0)
        assert (await admit(shared, 10, 10))[0] == 1, "releases sent before a decision free its room"
        assert count(shared, "admit") == 41 and count(shared, "release") == 10
        assert count(shared, "batch") < 10, f"{count(shared, 'batch')} round trips for 51 ops"


async def test_a_lapsed_lease_is_found_by_the_renewal_not_renewed_by_an_admission(redis: RedisServer) -> None:
    """Another guard's script removes a lapsed guard's fields, its epoch among them; the lapsed guard's next
    admission must neither bring its lease back nor be decided on a ledger without its earlier reservations:
    it is refused whole ("stale": the guard decides it alone, conservatively), and the resync that follows
    writes back everything the guard holds."""
    async with link(redis.url, lease_ttl_s=2.0, run=True) as shared:
        shared.holdings = lambda: ({"e": (6, 0)}, {})  # what this guard holds: 4 blocks, then 2 more
        assert (await admit(shared, 4, 64))[0] == 1
        async with aioredis.Redis.from_url(redis.url) as client:
            await client.zadd(scripts.KEYS[0], {shared.guard_id: 0})  # the lease lapsed (a long pause)
        assert await admit(shared, 2, 64) is None  # its prologue removed the lapsed guard's fields and epoch
        lost = shared.metrics.registry.get_sample_value("guard_shared_state_lost_total", {"reason": "stale"})
        assert lost == 1
        await asyncio.sleep(1.0)  # the link resyncs at once, then renews every 0.4 s (lease_ttl_s / 5)
        assert shared.up
        assert await ledger(redis.url) == {f"{shared.guard_id}|e|r": 6}, "the resync rewrote the whole ledger"


async def test_a_resync_while_decisions_are_on_their_way_writes_back_every_grant(redis: RedisServer) -> None:
    """The renewal finds the guard unknown (Redis restarted empty) while a round trip of admissions is on its
    way: the resync waits for it (its grants are recorded as they arrive), and decisions asked meanwhile go
    after the resync, so Redis ends up holding exactly what the guard holds."""
    async with link(redis.url, timeout_s=5.0) as shared:
        held = [0]

        def record(answer: Any) -> None:
            held[0] += 2 if answer is not None and answer[0] == 1 else 0

        shared.holdings = lambda: ({"e": (held[0], 0)}, {})
        async with aioredis.Redis.from_url(redis.url) as client:
            busy = asyncio.ensure_future(client.eval(BUSY_LUA, 0))  # Redis answers nobody for a while...
            await asyncio.sleep(0.05)
            first = [admit(shared, 2, 64, record) for _ in range(10)]
            await asyncio.sleep(0.05)  # ...so these wait in Redis, on their way, when the resync starts
            resyncing = asyncio.ensure_future(shared.resync())
            later = [admit(shared, 2, 64, record) for _ in range(10)]
            await busy
        assert await resyncing
        assert all(answer[0] == 1 for answer in await asyncio.gather(*first, *later))
        assert held[0] == 40 and await ledger(redis.url) == {f"{shared.guard_id}|e|r": 40}


def test_a_client_that_leaves_while_the_ledger_decides_holds_nothing(redis: RedisServer) -> None:
    with ServerThread(num_blocks=64) as engine, GuardThread(guard_config(
            engine.url, tenants=[{"name": "a", "api_keys": ["sk-a"]}], shared_state={"redis_url": redis.url})) as guard:
        state = guard.state
        assert state.shared is not None
        wait_for(lambda: guard.call(lambda: state.shared.up and state.pool.any_usable()), bool, 10)
        tenant = guard.call(lambda: state.keys.tenant_for("Bearer sk-a"))

        async def leave() -> None:
            ticket = Ticket("left", tenant, state.config.lanes[tenant.lane], 16, 48, 4)
            submitting = asyncio.create_task(state.dispatcher.submit(ticket))
            await asyncio.sleep(0)  # its admission is on the wire...
            submitting.cancel()  # ...when its client goes
            with contextlib.suppress(asyncio.CancelledError):
                await submitting

        guard.run(leave())
        wait_for(lambda: guard.call(lambda: (count(state.shared, "admit"), count(state.shared, "release"))),
                 lambda counts: counts == (1, 1), 5, message=lambda: "the grant was not given back")
        assert guard.run(ledger(redis.url)) == {}, "the ledger holds nothing"
        assert guard.call(lambda: state.pool.committed()) == 0
