"""SLO-aware admission (guard/admission/slo.py, guard/pool/latency.py, guard/http/objectives.py): objectives
from lanes and headers, the latency model, the critical band, lending sheddable blocks, early shedding, the
slo filter on real gates fed with snapshots; and one live guard in front of a real tiny engine for the
answers, the series and the decision record."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import aiohttp
import pytest
from support.admission_parts import BASE, make_dispatcher, pool_of, snapshot, write
from support.guard_server import GuardThread, guard_config
from support.processes import EngineProcess, Processes
from support.wait import until

from guard.admission import slo
from guard.admission.slo import BacklogPace, Departures, objective_for
from guard.admission.ticket import Ticket, TicketState
from guard.config import ConfigError, Lane, Routing, load_config
from guard.console.app import CONSOLE
from guard.errors import GuardError
from guard.pool.estimators import Fit, Quantile
from guard.pool.latency import MIN_FIT, MIN_SPREAD_SEEN, P90, LatencyModel, Sent
from guard.pool.scheduling import Request, profile_for

SLO_LANES = """
lanes:
  interactive: {priority: 1, slo: {ttft_ms: 1500, tpot_ms: 100}, priority_class: critical}
  batch: {priority: 4, timeout: 300, slo: {ttft_ms: 1000}, priority_class: sheddable}
"""


def slo_ticket(dispatcher, tenant: int, blocks: int, rid: str, header_ms: str | None = None) -> Ticket:
    """A ticket of tenant ``tenant`` (0: acme, critical; 1: bulk, sheddable) with its lane's objective."""
    t = dispatcher.config.tenants[tenant]
    lane = dispatcher.config.lanes[t.lane]
    objective = objective_for(lane, {"X-SLO-TTFT-Ms": header_ms} if header_ms else {})
    return Ticket(rid, t, lane, prompt_tokens=10, max_tokens=10, blocks=blocks, arrived=time.monotonic(),
                  objective=objective)


async def release_all(dispatcher, hog: Ticket, *waiting: asyncio.Task) -> None:
    """The end of a test that queued ``waiting`` behind ``hog``: they are cancelled, the hog finishes, and
    nothing is left reserved or queued."""
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    dispatcher.finish(hog)
    assert not dispatcher.pool.reservations() and not dispatcher.fair.queued


def slo_dispatcher(tmp_path: Path):
    dispatcher, _ = make_dispatcher(tmp_path)
    config = load_config(write(tmp_path, BASE + SLO_LANES))
    dispatcher.reconfigure(config)
    return dispatcher


def test_lanes_carry_objectives_and_a_bad_class_is_named(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, BASE + SLO_LANES))
    lane = config.lanes["interactive"]
    assert (lane.slo.ttft_ms, lane.slo.tpot_ms, lane.priority_class) == (1500, 100, "critical")
    assert config.lanes["batch"].priority_class == "sheddable"
    with pytest.raises(ConfigError, match="priority_class"):
        load_config(write(tmp_path, BASE + SLO_LANES.replace("critical", "urgent")))
    with pytest.raises(ConfigError, match="ttft_ms"):
        load_config(write(tmp_path, BASE + SLO_LANES.replace("1500", "-1")))


def test_headers_tighten_an_objective_never_loosen_it_and_a_bad_one_is_a_400_naming_it() -> None:
    lane = Lane.model_validate({"slo": {"ttft_ms": 1500}, "priority_class": "critical"})
    assert objective_for(lane, {}).ttft_s == 1.5
    assert objective_for(lane, {"X-SLO-TTFT-Ms": "400"}).ttft_s == 0.4
    assert objective_for(lane, {"X-SLO-TTFT-Ms": "9000"}).ttft_s == 1.5, "a header never loosens the lane's"
    tpot = objective_for(lane, {"X-SLO-TPOT-Ms": "50"})
    assert (tpot.ttft_s, tpot.tpot_s, tpot.priority_class) == (1.5, 0.05, "critical")
    assert objective_for(Lane(), {}) is None
    assert objective_for(Lane(), {"X-SLO-TTFT-Ms": "250"}).ttft_s == 0.25, "a lane without one gets the header's"
    for bad in ("abc", "-5", "0", "nan", "inf", ""):
        with pytest.raises(GuardError) as refused:
            objective_for(lane, {"X-SLO-TPOT-Ms": bad})
        assert (refused.value.status, refused.value.param, refused.value.code) == \
            (400, "X-SLO-TPOT-Ms", "invalid_slo_header")
        assert "X-SLO-TPOT-Ms" in refused.value.message


def test_the_latency_model_learns_base_and_prefill_rate_and_counts_work_by_engine_priority() -> None:
    model = LatencyModel()
    for i in range(3 * MIN_FIT):  # engine TTFT = 20 ms + 0.2 ms per token of work ahead
        work = 50 + 97 * (i % 7)
        model.observe_ttft(1, work, 0.020 + 2e-4 * work)
    base, per_token, per_running = model.coefficients(1)
    assert base == pytest.approx(0.020, rel=0.02) and per_token == pytest.approx(2e-4, rel=0.02)
    assert per_running == 0.0, "nothing known to be running: no slope for it"
    assert model.coefficients(104) == (base, per_token, 0.0), "a priority not seen yet: the fit over all of them"
    for i in range(MIN_FIT):
        model.observe_ttft(104, 300, 0.5)
    assert model.predict_ttft(104, 300, 0).median == pytest.approx(0.5, rel=0.01), "then its own"
    work, sent = model.admitted(1, 100, 100, 0)
    assert (work, sent.band, sent.running) == (100, (1, False), 0)
    work, sent = model.admitted(104, 500, 500, 1)
    assert (work, sent.band, sent.running) == (600, (104, False), 1), \
        "a borrower's prefill waits for every higher priority's, beside one request running"
    assert sent.ttft.median == pytest.approx(0.5 + 300 * 1e-4, rel=0.01), \
        "what was predicted for it when sent: 300 tokens more than its fit has seen, at the nominal rate"
    assert model.band(1) == (1, True), "a lower priority's prefill in flight: another band"
    assert model.ahead(1) == 100, "a lower priority's prefill is not ahead of a critical request"
    assert model.predict_ttft(1, 50, 2).median == pytest.approx(0.020 + 2e-4 * 150, rel=0.02)
    model.started(1, 100, 100)
    model.started(104, 500, 500)
    assert model.pending == {} and model.ahead(200) == 0


def test_the_fit_over_all_priorities_is_every_observation_and_each_priority_keeps_its_own() -> None:
    """While one engine priority alone was seen its fit is the one over all (one object, one update a
    request); a second priority copies it apart. Either way each fit is exactly the one its observations
    make, checked against fits fed separately, through the switch and past it."""
    model, rng = LatencyModel(), random.Random(7)
    every, own = Fit(), {1: Fit(), 101: Fit()}
    for i in range(60):
        priority = 1 if i < 25 or rng.random() < 0.6 else 101
        work, running, seconds = rng.randrange(10, 900), rng.randrange(0, 9), rng.uniform(0.005, 0.2)
        model.observe_ttft(priority, work, seconds, Sent((priority, False), running))
        every.add(work, running, seconds)
        own[priority].add(work, running, seconds)
        assert model._all.coefficients() == every.coefficients()
        for seen, fit in model._fits.items():
            assert fit.seen == own[seen].seen and fit.coefficients() == own[seen].coefficients()
    assert model._fits[1] is not model._all and model._fits[101].seen > 0


async def test_the_model_learns_from_every_judged_request_and_from_a_sample_of_the_others(tmp_path: Path) -> None:
    """Requests sent within ``SAMPLE_INTERVAL_S`` of the last sampled one are neither predicted nor learned from
    (their prefill still counts ahead of others), unless they carry an objective; the first one after it is."""
    dispatcher = slo_dispatcher(tmp_path)
    latency, tenant = dispatcher.pool.replicas[0].latency, dispatcher.config.tenants[0]
    plain = [Ticket(f"p{i}", tenant, dispatcher.config.lanes[tenant.lane], prompt_tokens=40, max_tokens=10,
                    blocks=1) for i in range(3)]  # the same lane, no objective
    judged = slo_ticket(dispatcher, 0, 1, "judged")
    latency._next_sample = time.monotonic() + 60  # the interval from the last sample runs past this test
    for t in plain[:2]:
        await dispatcher.submit(t)
    assert [t.sent for t in plain[:2]] == [None, None] and latency.ahead(priority := plain[0].priority) == 80
    await dispatcher.submit(judged)
    assert judged.sent is not None and judged.work == 80 + judged.prompt_tokens
    latency._next_sample = 0.0  # the interval has passed
    await dispatcher.submit(plain[2])
    assert plain[2].sent is not None and not latency.sample(time.monotonic()), "the next one waits its interval"
    for t in (*plain, judged):
        dispatcher.started(t, 0.05)
        dispatcher.finish(t)
    assert latency._all.seen == 2 and latency.ahead(priority) == 0 and not latency.pending


async def test_without_objectives_the_latency_model_is_kept_only_after_a_header_asks_for_one(tmp_path: Path) -> None:
    """A config that sets no objective: requests leave the latency model untouched (nothing pending, nothing
    predicted or learned) until one carries an X-SLO-* header; from it on, for ``slo.PREDICTING_S``, every
    request's prefill counts ahead and the sample is learned from again. A reload that sets an objective keeps
    the model for good; one that takes the objectives away keeps it ``PREDICTING_S`` more."""
    dispatcher, config = make_dispatcher(tmp_path)
    assert not slo.configured(config) and dispatcher.predicting_until == 0.0
    latency, tenant = dispatcher.pool.replicas[0].latency, config.tenants[0]
    lane = config.lanes[tenant.lane]

    def plain(rid: str) -> Ticket:
        return Ticket(rid, tenant, lane, prompt_tokens=40, max_tokens=10, blocks=1)

    before = plain("before")
    await dispatcher.submit(before)
    assert before.sent is None and not before.prefilling and not latency.pending, "nobody reads a prediction"
    asked = Ticket("asked", tenant, lane, prompt_tokens=30, max_tokens=10, blocks=1, arrived=time.monotonic(),
                   objective=objective_for(lane, {"X-SLO-TTFT-Ms": "2000"}))
    await dispatcher.submit(asked)
    assert asked.sent is not None and asked.work == 30, "judged, and the request before it is not ahead of it"
    assert 0 < dispatcher.predicting_until - time.monotonic() <= slo.PREDICTING_S
    after = plain("after")
    await dispatcher.submit(after)
    assert after.prefilling and latency.ahead(after.priority) == 70, "every request's prefill counts again"
    for t in (before, asked, after):
        dispatcher.started(t, 0.05)
        dispatcher.finish(t)
    assert not latency.pending and latency._all.seen >= 1, "what was counted went, and the judged one was learned"
    dispatcher.predicting_until = 0.0  # PREDICTING_S have passed
    dispatcher.reconfigure(load_config(write(tmp_path, BASE + SLO_LANES)))
    assert dispatcher.predicting_until == math.inf, "objectives in the config: kept for good"
    dispatcher.reconfigure(config)
    assert time.monotonic() < dispatcher.predicting_until <= time.monotonic() + slo.PREDICTING_S


def test_the_latency_model_learns_what_each_request_running_beside_a_prefill_costs() -> None:
    """Engine TTFT = 5 ms + 0.2 ms per token of work + 1.5 ms per request already running: the fit finds all
    three, and an interactive prompt (the same work every time) still gets the running term."""
    model = LatencyModel()
    for i in range(6 * MIN_FIT):
        work, running = 50 + 97 * (i % 7), (5 * i) % 21
        model.observe_ttft(1, work, 0.005 + 2e-4 * work + 1.5e-3 * running, Sent((1, False), running))
    base, per_token, per_running = model.coefficients(1)
    assert (base, per_token, per_running) == pytest.approx((0.005, 2e-4, 1.5e-3), rel=0.02)
    for i in range(6 * MIN_FIT):  # another priority: always 54 tokens, so no slope per token to fit
        running = (3 * i) % 17
        model.observe_ttft(2, 54, 0.010 + 1.5e-3 * running, Sent((2, False), running))
    for running in range(12):  # requests sent here, their first tokens come: only running now
        model.admitted(2, 54, 54, running)
        model.started(2, 54, 54)
    assert model.ahead(2) == 0
    assert model.predict_ttft(2, 54, 12).median == pytest.approx(0.010 + 1.5e-3 * 12, rel=0.02)
    assert model.predict_ttft(2, 54, 0).median == pytest.approx(0.010, rel=0.02), "the batch has drained"


def test_a_band_the_fit_misses_is_corrected_by_its_residual() -> None:
    model = LatencyModel()
    for _ in range(3 * MIN_FIT):  # alone: 20 ms; with a borrower's prefill in flight: 60 ms (its step first)
        model.observe_ttft(1, 50, 0.020, Sent((1, False), 0))
        model.observe_ttft(1, 50, 0.060, Sent((1, True), 0))
    alone = model.predict_ttft(1, 50, 0).median
    model.admitted(104, 500, 500, 0)
    behind = model.predict_ttft(1, 50, 1).median
    assert alone == pytest.approx(0.020, rel=0.1) and behind == pytest.approx(0.060, rel=0.1), (alone, behind)


async def test_critical_work_reclaims_what_sheddable_work_holds_and_goes_first(tmp_path: Path) -> None:
    dispatcher = slo_dispatcher(tmp_path)  # budget 85 of 100 blocks; acme critical, bulk sheddable (1 s)
    bulk = slo_ticket(dispatcher, 1, 80, "bulk")
    await dispatcher.submit(bulk)
    assert bulk.borrowed == 80, "a sheddable reservation is lent whole"
    critical = slo_ticket(dispatcher, 0, 15, "critical")
    await asyncio.wait_for(dispatcher.submit(critical), 1.0)
    assert critical.state is TicketState.ADMITTED and critical.borrowed == 0, "admitted at once, reclaiming"
    assert sum(r.in_flight for r in dispatcher.pool.replicas) == 2, "both running in the TTFT model"
    for t in (bulk, critical):
        dispatcher.finish(t)
    assert all(r.in_flight == 0 for r in dispatcher.pool.replicas), "ended: running nowhere"
    # The budget held by critical work: a sheddable ticket queues first, with the lower VTC counter, then a
    # critical one; of the 25 blocks a release frees, the critical one takes 10 and the sheddable one's 20
    # no longer fit.
    hog, piece = slo_ticket(dispatcher, 0, 60, "hog"), slo_ticket(dispatcher, 0, 25, "piece")
    for t in (hog, piece):
        await dispatcher.submit(t)
    waiting_bulk = slo_ticket(dispatcher, 1, 20, "waiting-bulk")
    first = asyncio.create_task(dispatcher.submit(waiting_bulk))
    await asyncio.sleep(0.01)
    dispatcher.fair.tenants["acme"].counter = 1e9
    waiting_critical = slo_ticket(dispatcher, 0, 10, "waiting-critical")
    second = asyncio.create_task(dispatcher.submit(waiting_critical))
    await asyncio.sleep(0.01)
    assert waiting_bulk.state is TicketState.QUEUED and waiting_critical.state is TicketState.QUEUED
    dispatcher.finish(piece)
    await asyncio.wait_for(second, 1.0)
    assert waiting_critical.state is TicketState.ADMITTED and waiting_bulk.state is TicketState.QUEUED
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    for t in (hog, waiting_critical):
        dispatcher.finish(t)
    assert not dispatcher.pool.reservations() and not dispatcher.fair.queued


async def test_a_sheddable_request_is_refused_at_arrival_or_leaves_the_queue_once_its_objective_passed(
        tmp_path: Path) -> None:
    """Queued, a sheddable ticket is served while it can still be on time; once its TTFT objective has passed
    unadmitted it leaves (served then, it would be late, on room that work still on time needs): 503
    ``queue_timeout`` naming the objective, long before its lane's 300 s timeout. A critical ticket waits
    its lane's timeout whatever its objective."""
    dispatcher = slo_dispatcher(tmp_path)
    hog = slo_ticket(dispatcher, 0, 85, "hog")  # the critical tenant fills the budget
    await dispatcher.submit(hog)
    queued = slo_ticket(dispatcher, 1, 40, "queued", header_ms="300")
    task = asyncio.create_task(dispatcher.submit(queued))
    await asyncio.sleep(0.01)
    assert queued.state is TicketState.QUEUED, "nothing has drained yet: no wait to predict, so it queues"
    with pytest.raises(GuardError) as late:
        await asyncio.wait_for(task, 5.0)
    assert (late.value.status, late.value.code) == (503, "queue_timeout"), late.value
    assert "0.3 s time-to-first-token objective" in late.value.message and not dispatcher.fair.queued
    critical = slo_ticket(dispatcher, 0, 4, "critical", header_ms="300")
    assert slo.queue_limit(critical, 0.0, 0.0) == critical.lane.timeout > 0.3
    dispatcher.departures = Departures()  # nothing drained again: the next one queues unjudged
    blocker = slo_ticket(dispatcher, 1, 40, "blocker")
    blocked = asyncio.create_task(dispatcher.submit(blocker))
    await asyncio.sleep(0.01)
    assert blocker.state is TicketState.QUEUED
    dispatcher.departures.sheddable.left(time.monotonic() - 1.0, 4)  # 4 sheddable blocks in 1 s of backlog
    late = slo_ticket(dispatcher, 1, 4, "late")  # 44 blocks at 4 blocks/s: ~11 s against 1 s
    started = time.monotonic()
    with pytest.raises(GuardError) as refused:
        await dispatcher.submit(late)
    assert time.monotonic() - started < 0.05 and late.state is TicketState.NEW, "refused before queueing"
    assert (refused.value.status, refused.value.code) == (503, "slo_unattainable")
    assert refused.value.retry_after is not None and 1 <= refused.value.retry_after <= 60
    assert late.predicted_ttft > 1.0
    await release_all(dispatcher, hog, blocked)


async def test_a_sheddable_request_predicted_late_but_not_surely_so_queues_and_leaves_in_time(
        tmp_path: Path) -> None:
    """Refused at arrival only where even the soonest of nine in ten such waits would make it late: one
    predicted at 1.5x its objective (the median) and 0.75x at the soonest (nothing learned yet: half the
    median) queues, and leaves once it can no longer be on time, its objective less the engine's part."""
    dispatcher = slo_dispatcher(tmp_path)
    hog = slo_ticket(dispatcher, 0, 85, "hog")
    await dispatcher.submit(hog)
    blocker = slo_ticket(dispatcher, 1, 2, "blocker")
    blocked = asyncio.create_task(dispatcher.submit(blocker))
    await asyncio.sleep(0.01)
    dispatcher.departures.sheddable.left(time.monotonic() - 1.0, 4)  # 4 sheddable blocks in 1 s of backlog
    hopeful = slo_ticket(dispatcher, 1, 4, "hopeful")  # (2 + 4) blocks at 4 blocks/s: 1.5 s against 1 s
    task = asyncio.create_task(dispatcher.submit(hopeful))
    await asyncio.sleep(0.01)
    assert hopeful.state is TicketState.QUEUED and 1.0 < hopeful.corrected_wait < 2.0, hopeful.corrected_wait
    # What it is told it is predicted is its TTFT if served: within its objective, or not at all.
    assert hopeful.predicted_ttft == pytest.approx(1.0, abs=0.02) and hopeful.predicted_ttft_p90 <= 1.0 + 0.02
    started = time.monotonic()
    with pytest.raises(GuardError) as late:
        await asyncio.wait_for(task, 5.0)
    assert (late.value.status, late.value.code) == (503, "queue_timeout")
    assert time.monotonic() - started <= 1.0 - (hopeful.predicted_engine or 0.0) + 0.2
    await release_all(dispatcher, hog, blocked)


async def test_a_queued_sheddable_request_whose_turn_comes_too_late_for_every_replica_leaves_then(
        tmp_path: Path) -> None:
    """Its deadline took the engine's part as predicted at arrival; when room comes and every usable replica
    would now be too slow for what is left of its objective, it leaves at once (as at its deadline) instead
    of being served late."""
    dispatcher = slo_dispatcher(tmp_path)
    hog = slo_ticket(dispatcher, 0, 85, "hog")
    await dispatcher.submit(hog)
    queued = slo_ticket(dispatcher, 1, 4, "queued", header_ms="900")
    task = asyncio.create_task(dispatcher.submit(queued))
    await asyncio.sleep(0.01)
    assert queued.state is TicketState.QUEUED
    replica = dispatcher.pool.replicas[0]
    assert replica.usable()
    replica.latency.on_snapshot(snapshot().model_copy(update={"step_time_s": 5.0}), 1)  # the replica slowed down
    started = time.monotonic()
    dispatcher.finish(hog)  # room: its turn
    with pytest.raises(GuardError) as late:
        await asyncio.wait_for(task, 5.0)
    assert (late.value.status, late.value.code) == (503, "queue_timeout") and "0.9 s" in late.value.message
    assert time.monotonic() - started < 0.1, "at once, not at its deadline"
    assert queued.state is TicketState.DONE and not dispatcher.pool.reservations() and not dispatcher.fair.queued


async def test_a_sheddable_request_that_fits_now_is_not_refused_by_a_pace_learned_long_ago(tmp_path: Path) -> None:
    """The sheddable pace moves only while sheddable tickets queue: a slow one learned earlier (4 blocks in
    10 s of backlog) would predict 10 s for a ticket that the idle pool admits at once, and refuse it, and
    every one after it, with nothing ever queued to correct it."""
    dispatcher = slo_dispatcher(tmp_path)
    dispatcher.departures.sheddable.left(time.monotonic() - 10.0, 4)
    ticket = slo_ticket(dispatcher, 1, 4, "fits", header_ms="1000")
    await dispatcher.submit(ticket)
    assert ticket.state is TicketState.ADMITTED and ticket.predicted_ttft < 1.0
    dispatcher.finish(ticket)
    assert not dispatcher.pool.reservations()


async def test_tickets_rejected_from_the_queue_count_as_departures_and_leave_it_idle(tmp_path: Path) -> None:
    """A rejected queue (a confirmed attacker's, or shutdown) is left as a deadline leaves it: its blocks in the
    queue's pace, and the queue idle after, so the seconds it then stands empty do not lower the pace."""
    dispatcher = slo_dispatcher(tmp_path)
    hog = slo_ticket(dispatcher, 0, 85, "hog")
    await dispatcher.submit(hog)
    waiting = [asyncio.create_task(dispatcher.submit(slo_ticket(dispatcher, 1, 20, f"q{i}"))) for i in range(2)]
    await asyncio.sleep(0.01)
    assert dispatcher.fair.queued == 2 and dispatcher.departures.rate() == 0
    assert dispatcher.reject_queued("bulk", GuardError(403, "rejected", code="tenant_blocked")) == 2
    # 40 blocks over the queue's busy time, counted as a second at least (two on a very slow machine)
    assert 20.0 <= dispatcher.departures.rate() <= 40.0
    for task in waiting:
        with pytest.raises(GuardError):
            await task
    dispatcher.finish(hog)
    assert not dispatcher.pool.reservations() and not dispatcher.fair.queued


def test_the_sheddable_pace_shows_a_drop_a_stall_and_a_new_backlog_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(slo.time, "monotonic", lambda: clock[0])
    pace = BacklogPace()

    def admit_after(wait: float, times: int) -> None:  # one ticket at a time, each queued ``wait`` seconds
        for _ in range(times):
            clock[0] += wait
            pace.left(clock[0] - wait, 40)

    admit_after(0.5, 20)  # 10 s of backlog at 80 blocks/s
    assert pace.rate() == pytest.approx(80.0)
    admit_after(2.0, 3)  # the pace quarters: the 10 s window says 48 blocks/s (its fast part: 6.0-10.0 s)
    assert pace.rate() == pytest.approx(6 * 40 / 7.5), "the last 6 admissions and the backlog since"
    queued_since = clock[0] - 1.0  # a ticket queued before the last admission is still waiting 5 s later
    clock[0] += 5.0
    assert pace.rate(queued_since) == pytest.approx(6 * 40 / 12.5), "a stall lowers it before anything leaves"
    assert pace.rate() == pytest.approx(6 * 40 / 7.5), "none queued: the backlog ended with the last admission"
    admit_after(0.5, 6)  # faster again: the long window's figure, not the recent one's
    assert pace.rate() == pytest.approx((3 + 3 + 6) * 40 / 10.0)  # backlog 9-19 s: 3 fast, 3 slow, 6 fast
    clock[0] += 5.0  # nothing queued for 5 s; then a new backlog, whose first ticket has waited 2 s
    queued_since = clock[0]
    clock[0] += 2.0
    assert pace.rate(queued_since) == pytest.approx(40 / 2.0), "one admission's blocks over the wait so far"
    pace.left(queued_since, 40)
    assert pace.rate() == pytest.approx(40 / 2.0), "the new backlog's own pace, not the last one's"


def test_the_slo_filter_holds_back_a_replica_predicted_to_be_late() -> None:
    profile = profile_for(Routing())  # the kvguard preset
    pool = pool_of([100, 100, 100])
    pool.by_name["e1"].latency.admitted(0, 50_000, 50_000, 0)  # 50k prefill tokens ahead there: seconds
    ranked = profile.rank(pool.replicas, Request(4, [], prompt_tokens=100, ttft_left_s=1.0, priority=1))
    assert ranked[-1].replica.name == "e1" and ranked[-1].filtered_by == "slo"
    assert all(c.filtered_by is None for c in ranked[:-1])
    unhurried = profile.rank(pool.replicas, Request(4, [], prompt_tokens=100))
    assert all(c.filtered_by is None for c in unhurried), "without an objective nothing is held back"


def test_the_slo_filter_holds_a_sheddable_request_to_the_median_and_others_to_the_p90() -> None:
    profile = profile_for(Routing())
    pool = pool_of([100, 100, 100])
    e1 = pool.by_name["e1"]
    e1.latency.admitted(1, 20_000, 20_000, 0)  # work ahead there
    e1.latency._spread[None] = Quantile(P90, value=math.log(4.0), seen=MIN_SPREAD_SEEN)  # p90: 4x the median
    median = e1.latency.predict_ttft(1, 100, e1.in_flight).median
    for sheddable, held in ((False, True), (True, False)):
        ranked = profile.rank(pool.replicas, Request(4, [], prompt_tokens=100, ttft_left_s=2 * median, priority=1,
                                                     sheddable=sheddable))
        assert (next(c for c in ranked if c.replica is e1).filtered_by == "slo") is held, (sheddable, ranked)


# -- live: a guard in front of a real tiny engine ---------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with Processes(tmp_path_factory.mktemp("slo")) as processes:
        yield processes.engine("--num-blocks", "256")


async def test_live_objectives_answers_series_and_decision_record(engine: EngineProcess) -> None:
    lanes = {"interactive": {"priority": 1, "slo": {"ttft_ms": 5000, "tpot_ms": 1000}, "priority_class": "critical"},
             "batch": {"priority": 4, "slo": {"ttft_ms": 60000}, "priority_class": "sheddable"}}
    config = guard_config(engine.url, lanes=lanes, admin={"host": "127.0.0.1", "port": 0})
    # Greedy: a sampled answer may decode to text in one event (tokens of no text are held back), and a stream
    # of one event has no TPOT to judge.
    body = {"model": "tiny", "prompt": "how long until my first token?", "max_tokens": 8, "stream": True,
            "temperature": 0.0}
    with GuardThread(config) as guard:
        async with aiohttp.ClientSession() as session:
            async def post(key: str, headers: dict[str, str] | None = None) -> tuple[int, Mapping, bytes]:
                async with session.post(guard.url + "/v1/completions", json=body,
                                        headers={"Authorization": f"Bearer {key}", **(headers or {})}) as answer:
                    return answer.status, answer.headers.copy(), await answer.read()

            for _ in range(3):  # served and counted; the pool drains, so waits can be predicted
                status, headers, _ = await post("sk-acme")
                assert status == 200
            async with session.get(f"{guard.app[CONSOLE].url}/requests/{headers['X-Request-Id']}") as answer:
                record = await answer.json()
            assert record["slo"]["priority_class"] == "critical" and record["slo"]["ttft_ms"] == 5000
            assert record["slo"]["predicted_ttft_ms"] > 0 and record["slo"]["met"] == {"ttft": True, "tpot": True}
            predicted = record["slo"]
            assert predicted["predicted_ttft_p90_ms"] >= predicted["predicted_ttft_ms"], "the p90 is no lower"
            assert predicted["predicted_engine_ms"] > 0 and predicted["observed_tpot_ms"] > 0
            assert predicted["late_in_queue"] is False, "admitted at once, it never waited past its objective"
            assert predicted["predicted_tpot_p90_ms"] is None or \
                predicted["predicted_tpot_p90_ms"] >= predicted["predicted_tpot_ms"] > 0
            status, _, raw = await post("sk-acme", {"X-SLO-TTFT-Ms": "soon"})
            assert status == 400 and b"X-SLO-TTFT-Ms" in raw
            await until(lambda: guard.call(lambda: guard.state.pool.expected_wait(1)), lambda w: w is not None, 10.0)
            started = time.monotonic()
            status, headers, raw = await post("sk-bulk", {"X-SLO-TTFT-Ms": "1"})  # no engine answers in 1 ms
            assert time.monotonic() - started < 1.0
            assert status == 503 and b"slo_unattainable" in raw and 1 <= int(headers["Retry-After"]) <= 60
            async with session.get(guard.url + "/metrics") as answer:
                metrics = await answer.text()
    assert 'guard_slo_requests_total{lane="interactive",met="true",objective="ttft",priority_class="critical"} 3.0' in metrics
    assert 'guard_slo_requests_total{lane="batch",met="false",objective="ttft",priority_class="sheddable"} 1.0' in metrics
    assert 'guard_ttft_predicted_seconds_count{lane="interactive"} 3' in metrics
    assert 'guard_ttft_prediction_error_seconds_count{lane="interactive"} 3' in metrics
