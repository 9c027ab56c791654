"""Conservative mode keeps its promise (issue 29): while guards that share state cannot reach Redis, each commits
at most its share of an engine less what the others held beyond theirs, on every path (a first reservation,
borrowed or guaranteed, and a growing one); and a guard back from an outage shares the ledger again only once
the others have written theirs back."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.admission_parts import snapshot
from support.redis_server import RedisServer

from guard.config import Admission
from guard.config import SharedState as SharedStateConfig
from guard.metrics import GuardMetrics
from guard.pool.gate import AdmissionGate
from guard.state.shared import SharedState
from guard.state.sightings import PERIODS, Sightings


def gate(share: float, others: dict[str, int]) -> AdmissionGate:
    """100 blocks, safe_utilization 0.8: 80 under the threshold, 100 in the pool."""
    built = AdmissionGate(Admission(safe_utilization=0.8, resume_utilization=0.7), {"a", "b"})
    built.update(snapshot(num_blocks=100, free=100))
    built.share, built.others = share, others
    return built


def test_a_guard_alone_keeps_to_its_share_less_what_the_other_holds_beyond_its_own() -> None:
    # The other guard borrowed 60 of the 80 while Redis was up: 20 past its share of 40.
    g = gate(0.5, {"g2": 60})
    assert g.mine(80) == 20 and g.mine(100) == 40  # its pool share (50) less the other's 10 past 50
    assert g.try_reserve("r1", "a", 20, borrowed=20)
    # Guaranteed: borrowed blocks are reclaimable under the threshold, but never past the pool's share.
    assert g.try_reserve("r2", "b", 20)
    assert not g.try_reserve("r3", "b", 1) and not g.try_reserve("r4", "a", 1, borrowed=1)
    assert g.reserved == 40 and 40 + 60 <= 100, "together within the pool"


def test_a_growing_reservation_keeps_to_the_share_too() -> None:
    g = gate(0.5, {})
    assert g.try_reserve("r1", "a", 30, borrowed=30)
    assert g.try_grow("r1", 10) and not g.try_grow("r1", 1), "40 of 80 is this guard's share"
    g.share = 1.0
    assert g.try_grow("r1", 40) and not g.try_grow("r1", 1), "with the link up, the whole threshold"


def test_other_guards_within_their_share_cost_nothing() -> None:
    assert gate(1 / 3, {"g2": 10, "g3": 26}).mine(90) == 30
    assert gate(1 / 3, {"g2": 10, "g3": 40}).mine(90) == 20  # one of them holds 10 past its 30


def test_an_outage_counts_the_others_at_their_recent_peak_not_their_last_dip() -> None:
    """A guard at its plateau dips between grants (a request ended, the next not yet granted): the last
    sighting alone would leave room that it refills before anyone sees it (issue 29's lopsided outage)."""
    seen = Sightings()
    seen.renewed({"e0": {"g2": 48}})
    seen.saw("e0", {"g2": 40, "g3": 2})  # an admission's answer, between two renewals
    seen.renewed({"e0": {"g2": 42}})
    assert seen.peak("e0") == {"g2": 48, "g3": 2} and seen.peak("e1") == {}
    for _ in range(PERIODS - 2):  # a sighting counts for PERIODS renewal periods (its own the first), no more
        seen.renewed({"e0": {"g2": 10}})
    assert seen.peak("e0") == {"g2": 48, "g3": 2}
    seen.renewed({"e0": {"g2": 10}})
    assert seen.peak("e0") == {"g2": 42}


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path) as server:
        yield server


def make_link(url: str) -> SharedState:
    shared = SharedState(SharedStateConfig(redis_url=url, lease_ttl_s=3.0, timeout_s=0.25), GuardMetrics())
    shared.holdings = lambda: ({"e": (10, 0)}, {})
    return shared


async def test_back_from_an_outage_a_guard_waits_for_the_others_to_write_back(redis: RedisServer) -> None:
    """Redis restarts empty: the first guard back finds itself alone in it, but two guards were live, so it
    stays conservative (its link down, its holdings written, marked alone) until the second has resynced
    too; meanwhile the second, back, counts it at its share at least."""
    first, second = make_link(redis.url), make_link(redis.url)
    try:
        assert await first.resync() and await second.resync()
        await first.renew()
        assert first.up and first.live_guards == 2
        redis.kill()
        for shared in (first, second):  # each finds its connection gone
            await shared.renew()
            assert not shared.up
        redis.start()
        assert not await first.resync(), "one guard of two in Redis: not up yet"
        assert not first.up and first.live_guards == 2
        assert await second.resync()
        # The second decides through the ledger; the first, still alone, counts at its share (20 of 40) at
        # least, though it wrote 10: with the second's own 10, 10 more fit and 11 do not.
        delivering = asyncio.create_task(second.deliver())
        assert (await second.ask("ADMIT", "e", "t", 11, 0, 40, 40, 1.0, 64.0))[:2] == [0, "full"]
        assert (await second.ask("ADMIT", "e", "t", 10, 0, 40, 40, 1.0, 64.0))[0] == 1
        second.stop()
        await delivering
        assert await first.resync() and first.up and first.live_guards == 2
    finally:
        for shared in (first, second):
            shared.stop()
            await shared.close()
