"""Attack-safe defaults without any ``max_blocks_share``: guaranteed weighted shares, borrowing of idle
capacity that a tenant within its guarantee reclaims, revocation of a confirmed attacker's running work (on
both state backends: the guard alone, and the ledger in a real Redis), and the detector's cross-key
coordination and persistent confirmation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from support.admission_backends import BACKENDS, one_replica
from support.admission_parts import ticket
from support.detector_script import run, squeeze
from support.redis_server import RedisServer

from guard.admission.dispatch import Dispatcher
from guard.admission.ticket import TicketState
from guard.config import GuardConfig
from guard.detect.coordination import SYNC_S
from guard.detect.detector import CLEAR_CONFIRMED_AFTER_S, Detector
from guard.errors import GuardError

Admitted = tuple[Dispatcher, GuardConfig]


@pytest.fixture(params=BACKENDS)
async def admission(request: pytest.FixtureRequest, tmp_path: Path, redis: RedisServer) -> AsyncIterator[Admitted]:
    """A dispatcher in front of one replica of 100 blocks (budget 85), on each state backend."""
    async with one_replica(request.param, tmp_path, redis) as pair:
        yield pair


async def test_a_tenant_alone_borrows_the_whole_budget(admission: Admitted) -> None:
    dispatcher, config = admission  # budget 85 blocks; bulk (weight 1 of 3) guaranteed 28
    bulk = config.tenants[1]
    assert dispatcher.guarantee(bulk) == 28
    tickets = [ticket(config, 1, 5, f"r{i}") for i in range(17)]
    for t in tickets:
        await dispatcher.submit(t)
    assert all(t.state is TicketState.ADMITTED for t in tickets)
    assert dispatcher.pool.tenant_reserved(bulk.name) == 85, "alone, a tenant gets the whole budget"
    assert sum(t.borrowed for t in tickets) == 85 - 28
    for t in tickets:
        dispatcher.finish(t)
    assert not dispatcher.pool.reservations() and not dispatcher.pool.replicas[0].gate.borrowed


async def test_a_tenant_within_its_guarantee_reclaims_borrowed_blocks(admission: Admitted) -> None:
    dispatcher, config = admission
    hog = ticket(config, 1, 80, "hog")
    await dispatcher.submit(hog)
    assert hog.borrowed == 80 - 28
    small = ticket(config, 0, 10, "small")  # acme: weight 2, guaranteed 56
    await asyncio.wait_for(dispatcher.submit(small), 1.0)
    assert small.state is TicketState.ADMITTED and small.borrowed == 0, "admitted at once, borrowing nothing"
    gate = dispatcher.pool.replicas[0].gate
    assert gate.committed() > gate.budget >= gate.committed() - gate.borrowed, "only borrowers pass the budget"
    over = ticket(config, 0, 50, "over")  # 10 + 50 > 56: 4 blocks past acme's guarantee, and no idle room
    task = asyncio.create_task(dispatcher.submit(over))
    await asyncio.sleep(0.01)
    assert over.state is TicketState.QUEUED, "a ticket that borrows must fit idle capacity"
    dispatcher.finish(hog)
    await asyncio.wait_for(task, 1.0)
    assert over.borrowed == 4
    for t in (small, over):
        dispatcher.finish(t)
    assert not dispatcher.pool.reservations()


async def test_a_borrower_that_does_not_fit_does_not_hold_up_a_guaranteed_tenant(admission: Admitted) -> None:
    dispatcher, config = admission
    hog = ticket(config, 1, 80, "hog")  # bulk borrows 52 past its 28
    await dispatcher.submit(hog)
    blocked = ticket(config, 1, 20, "blocked")  # all borrowed, and 5 blocks of idle room: it waits
    first = asyncio.create_task(dispatcher.submit(blocked))
    await asyncio.sleep(0.01)
    dispatcher.fair.tenants["acme"].counter = 1e9  # so that VTC picks bulk's head first
    within = ticket(config, 0, 10, "within")  # acme's, within its guarantee of 56
    second = asyncio.create_task(dispatcher.submit(within))
    await asyncio.wait_for(second, 1.0)
    assert within.state is TicketState.ADMITTED and blocked.state is TicketState.QUEUED, \
        "the borrower at the head of the VTC order was passed over, not waited for"
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    for t in (hog, within):
        dispatcher.finish(t)
    assert not dispatcher.pool.reservations()


async def test_a_borrower_that_does_not_fit_leaves_the_threshold_of_guaranteed_work_as_it_was(
        admission: Admitted) -> None:
    """The gate's hysteresis: a miss closes it to ``resume_utilization`` (76 of 100 blocks here), but a
    borrower's miss only to borrowers. Before, it closed the gate to everyone, and a guaranteed request that
    fit under ``safe_utilization`` (85) waited until a release brought the pool down to 76."""
    dispatcher, config = admission
    gate = dispatcher.pool.replicas[0].gate
    first = [ticket(config, 0, 45, "acme-1"), ticket(config, 1, 28, "bulk-1")]  # both within their guarantee
    for t in first:
        await dispatcher.submit(t)
    assert [t.borrowed for t in first] == [0, 0] and gate.reserved == 73
    lent = ticket(config, 1, 20, "bulk-2")  # past bulk's 28, all borrowed: 73 + 20 > 85, it waits
    waiting = asyncio.create_task(dispatcher.submit(lent))
    await asyncio.sleep(0.01)
    assert lent.state is TicketState.QUEUED and gate.open and not gate.lending
    within = ticket(config, 0, 8, "acme-2")  # acme 53 of its 56: 73 + 8 = 81, under 85 but past 76
    await asyncio.wait_for(dispatcher.submit(within), 1.0)
    assert within.state is TicketState.ADMITTED and within.borrowed == 0
    assert lent.state is TicketState.QUEUED, "a borrower still needs idle room"
    for t in first:
        dispatcher.finish(t)
    await asyncio.wait_for(waiting, 1.0)
    assert lent.state is TicketState.ADMITTED and gate.open and gate.lending
    for t in (within, lent):
        dispatcher.finish(t)
    assert not dispatcher.pool.reservations()


async def test_revoke_tells_every_running_ticket_of_the_tenant_why(admission: Admitted) -> None:
    dispatcher, config = admission
    told: list[tuple[str, GuardError]] = []
    tickets = [ticket(config, 1, 10, f"a{i}") for i in range(2)] + [ticket(config, 0, 10, "bystander")]
    for t in tickets:
        await dispatcher.submit(t)
        t.on_revoke = lambda reason, name=t.request_id: told.append((name, reason))
    reason = GuardError(429, "attack", code="abuse_suspected", retry_after=60)
    assert dispatcher.revoke("bulk", reason) == 2
    assert sorted(name for name, _ in told) == ["a0", "a1"] and all(r is reason for _, r in told)
    assert tickets[2].revoked is None
    for t in tickets:
        dispatcher.finish(t)
    assert dispatcher.revoke("bulk", reason) == 0 and not dispatcher.running


def attack_on_two_keys(detector: Detector, offset: float) -> callable:
    """Probes alternating between keys a and b (the second key ``offset`` s late), a long generation on each
    key every 2 s, micro-requests from both: one attacker's Fill-and-Squeeze, split over two keys."""
    def act(now: float) -> None:
        tick = round(now / 0.25)
        key = "a" if tick % 2 else "b"
        if key == "a" or now >= offset:
            detector.on_request(key, 2, now)
            if tick % 8 < 2:
                detector.on_request(key, 600, now)
            detector.on_request(key, 8, now)
    return act


def test_keys_that_start_together_are_linked_and_both_confirmed() -> None:
    d = Detector({"a": 1, "b": 1, "victim": 2})
    _, changes = run(d, 8, 0.25, attack_on_two_keys(d, 0.0), lambda _: {"a": 30, "b": 30},
                     {"a", "b", "victim"}, lambda _: 0.1)
    assert d.tenants["a"].evidence["coordination"] == d.tenants["b"].evidence["coordination"] == 1.0
    assert d.state("a") == d.state("b") == "confirmed"
    assert d.state("victim") == "normal" and not any(name == "victim" for name, _, _ in changes)


def test_keys_that_start_apart_are_not_linked() -> None:
    d = Detector({"a": 1, "b": 1})
    run(d, 8, 0.25, attack_on_two_keys(d, SYNC_S + 3.0), lambda _: {}, set(), lambda _: 0.9)
    assert d.tenants["a"].evidence["coordination"] == d.tenants["b"].evidence["coordination"] == 0.0


def test_confirmation_holds_while_the_pattern_goes_on_and_clears_after_it_stops() -> None:
    d = Detector({"attacker": 1, "victim": 2})
    now, _ = run(d, 8, 0.05, squeeze(d, "attacker"), lambda _: {"attacker": 60}, {"attacker", "victim"},
                 lambda _: 0.1)
    assert d.state("attacker") == "confirmed"
    # Refused from now on, it holds nothing, and its score falls to what its probes give, below the clear
    # level; it keeps probing every 0.25 s for twice the clear time: still confirmed.
    now, _ = run(d, 2 * CLEAR_CONFIRMED_AFTER_S, 0.25, lambda t: d.on_request("attacker", 2, t),
                 lambda _: {}, set(), lambda _: 0.9, start=now)
    assert d.tenants["attacker"].score < 0.4 and d.state("attacker") == "confirmed"
    # It stops: once its window has emptied and the clear time has passed, it is only suspect.
    run(d, CLEAR_CONFIRMED_AFTER_S + 12, 0.5, lambda t: None, lambda _: {}, set(), lambda _: 0.9, start=now)
    assert d.state("attacker") == "suspect"
