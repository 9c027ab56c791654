"""The live planner behind ``guard_desired_replicas`` and ``guard_saturation`` (guard/plan/live.py) on a
synthetic clock: what it measures from a pool's readings, the count it plans, its hysteresis; and the wait
target the guard takes from its lanes (guard/server/autoscale.py). The live signals, with a real engine
and guard under load, are tests/guard/test_autoscale_live.py."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from pydantic import ValidationError
from support.guard_server import guard_config

from guard.config import Autoscaling
from guard.plan.live import LivePlanner, Reading
from guard.plan.queueing import mean_wait, replicas_for_wait
from guard.server.autoscale import max_wait_s

BUDGET = 100  # blocks one replica may commit
BLOCKS = 10  # blocks one request reserves: 10 stream slots per replica


def steady(t: float, rate: float, service_s: float, replicas: int = 1, guards: int = 1, queued: int = 0,
           queued_blocks: int = 0, budget: int = BUDGET) -> Reading:
    """A pool at time ``t`` into a load of ``rate`` requests/s (this guard's share) each served in
    ``service_s`` (Little: ``rate x service_s`` running), started at t = 0."""
    running = round(rate * service_s)
    return Reading(time=t, admitted_total=rate * t, shed_total=0.0, queued=queued, queued_blocks=queued_blocks,
                   in_flight=running, reserved_blocks=running * BLOCKS, committed_blocks=running * BLOCKS,
                   budget_blocks=budget * replicas, replicas=replicas, guards=guards)


def run(planner: LivePlanner, readings, max_wait: float = 0.5):
    return [planner.update(reading, max_wait) for reading in readings][-1]


def test_an_idle_pool_wants_the_minimum_and_is_not_saturated():
    planner = LivePlanner(window_s=10, scale_down_delay_s=30, min_replicas=2)
    signals = run(planner, (steady(t, 0.0, 1.0, replicas=2) for t in range(12)))
    assert (signals.desired, signals.saturation, signals.arrival_rate) == (2, 0.0, 0.0)


def test_a_steady_load_gets_the_erlang_c_count_of_its_measured_rate_and_service_time():
    """Arrivals 2/s held 4 s each: 8 Erlangs on slots of 10 per replica. One replica is stable (80 %) but
    its mean wait is over the 0.5 s target; the count is the fewest replicas whose wait meets it."""
    planner = LivePlanner(window_s=10, scale_down_delay_s=30)
    signals = run(planner, (steady(t, 2.0, 4.0) for t in range(21)))
    assert signals.arrival_rate == pytest.approx(2.0)
    assert signals.service_s == pytest.approx(4.0)
    assert signals.slots_per_replica == BUDGET // BLOCKS
    assert mean_wait(10, 8.0, 4.0) > 0.5 >= mean_wait(20, 8.0, 4.0)
    assert signals.desired == replicas_for_wait(10, 2.0, 4.0, 0.5) == 2
    assert signals.saturation == pytest.approx(0.8)  # offered load over the slots of the one replica up


def test_a_looser_wait_target_needs_fewer_replicas():
    planner = LivePlanner(window_s=10, scale_down_delay_s=30)
    assert run(planner, (steady(t, 2.0, 4.0) for t in range(21)), max_wait=60.0).desired == 1


def test_blocks_waiting_beyond_the_budgets_raise_the_count_at_once():
    """The memory side needs no window: 80 blocks committed and 150 queued need three budgets of 100."""
    planner = LivePlanner(window_s=30, scale_down_delay_s=30)
    run(planner, (steady(t, 0.0, 1.0) for t in range(5)))
    busy = replace(steady(5, 0.0, 1.0, queued=15, queued_blocks=150), in_flight=8, committed_blocks=80)
    signals = planner.update(busy, 0.5)
    assert (signals.raw, signals.desired, signals.saturation) == (3, 3, 1.0)


def test_the_count_falls_only_after_the_scale_down_delay_and_then_to_the_highest_of_it():
    planner = LivePlanner(window_s=5, scale_down_delay_s=20)
    assert planner.update(steady(0, 0.0, 1.0, queued=30, queued_blocks=300), 0.5).desired == 3
    published = [planner.update(steady(t, 0.0, 1.0), 0.5) for t in range(1, 31)]
    assert all(s.raw == 1 for s in published)
    assert [s.desired for s in published[:20]] == [3] * 20  # t = 1..20: the 3 of t = 0 is within 20 s
    assert [s.desired for s in published[20:]] == [1] * 10
    assert published[-1].saturation == 0.0


def test_a_raw_count_that_wavers_publishes_the_higher_one_without_flapping():
    planner = LivePlanner(window_s=5, scale_down_delay_s=10)
    desired = [planner.update(steady(t, 0.0, 1.0, queued_blocks=150 if t % 2 else 50), 0.5).desired
               for t in range(40)]
    assert desired[1:] == [2] * 39


def test_max_replicas_caps_the_count():
    planner = LivePlanner(window_s=5, scale_down_delay_s=10, max_replicas=2)
    assert planner.update(steady(0, 0.0, 1.0, queued_blocks=1000), 0.5).desired == 2
    with pytest.raises(ValueError, match="max_replicas"):
        LivePlanner(window_s=5, scale_down_delay_s=10, min_replicas=3, max_replicas=2)


def test_without_telemetry_the_count_holds_and_demand_reads_as_saturated():
    planner = LivePlanner(window_s=5, scale_down_delay_s=0)
    assert planner.update(steady(0, 0.0, 1.0, queued_blocks=250), 0.5).desired == 3
    blind = planner.update(steady(1, 0.0, 1.0, queued=4, budget=0), 0.5)
    assert (blind.raw, blind.desired, blind.saturation) == (None, 3, 1.0)
    assert planner.update(steady(2, 0.0, 1.0, budget=0), 0.5).saturation == 0.0


def test_arrivals_count_every_guard_that_shares_the_pool():
    """Two guards behind one load balancer: each sees half the arrivals, and plans for both halves."""
    one = run(LivePlanner(window_s=10, scale_down_delay_s=30), (steady(t, 2.0, 4.0) for t in range(21)))
    halves = run(LivePlanner(window_s=10, scale_down_delay_s=30),
                 (steady(t, 1.0, 4.0, guards=2) for t in range(21)))
    assert halves.arrival_rate == pytest.approx(one.arrival_rate)


def test_requests_shed_or_still_queued_are_arrivals_too():
    planner = LivePlanner(window_s=10, scale_down_delay_s=30)
    base = steady(0, 0.0, 1.0)
    later = Reading(time=10, admitted_total=10, shed_total=5, queued=5, queued_blocks=50, in_flight=1,
                    reserved_blocks=10, committed_blocks=10, budget_blocks=BUDGET, replicas=1)
    planner.update(base, 0.5)
    assert planner.update(later, 0.5).arrival_rate == pytest.approx(2.0)  # (10 + 5 + 5) / 10 s


def test_the_wait_target_is_a_share_of_the_tightest_objective_of_the_lanes_in_use():
    lanes = {"interactive": {"priority": 1, "slo": {"ttft_ms": 1500}},
             "batch": {"priority": 4, "slo": {"ttft_ms": 10000}},
             "realtime": {"priority": 0, "slo": {"ttft_ms": 100}}}  # no tenant uses it
    config = guard_config("http://127.0.0.1:1", lanes=lanes, autoscaling={"wait_share": 0.4})
    assert max_wait_s(config) == pytest.approx(0.6)
    assert max_wait_s(guard_config("http://127.0.0.1:1", autoscaling={"max_wait_s": 2})) == 2.0


def test_the_config_refuses_bounds_out_of_order():
    with pytest.raises(ValidationError, match="max_replicas"):
        Autoscaling(min_replicas=3, max_replicas=2)
    with pytest.raises(ValidationError, match="window_s"):
        Autoscaling(interval_s=5, window_s=1)


def test_the_wait_search_extends_erlang_b_once_and_stops_at_its_limit() -> None:
    """The incremental search gives what trying each count with mean_wait gives, and a huge reading (a
    million arrivals a second for 30 s each) stops at the limit instead of walking millions of servers."""
    for slots, rate, service_s, wait_s in [(10, 2.0, 4.0, 0.5), (4, 30.0, 2.0, 0.05), (1, 0.5, 1.0, 0.01)]:
        tried = max(1, math.floor(rate * service_s / slots) + 1)
        while mean_wait(tried * slots, rate * service_s, service_s) > wait_s:
            tried += 1
        assert replicas_for_wait(slots, rate, service_s, wait_s) == tried
        assert replicas_for_wait(slots, rate, service_s, wait_s, limit=tried + 5) == tried
    assert replicas_for_wait(8, 1e6, 30.0, 0.05, limit=64) == 64
    assert replicas_for_wait(8, 20.0, 3.0, 1e-9, limit=3) == 3  # the wait never gets that low by 3
    # A replica of millions of slots (bench/fast_upstream.py's budget over one-block requests): one is enough.
    assert replicas_for_wait(8_000_000, 500.0, 0.1, 1.0, limit=1024) == 1
