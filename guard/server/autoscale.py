"""Publishes the autoscaling signals: every ``autoscaling.interval_s`` the guard's pool is read into a
`Reading` (guard/plan/live.py), and the live planner's answer set on ``guard_desired_replicas{pool}`` and
``guard_saturation{pool}``.

Nothing here runs per request: the reading sums counters and levels the guard keeps anyway (requests
routed to each replica, outcomes, the queue, each replica's in-flight count and reservations), so the
request path pays nothing for the signals.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from guard.admission.dispatch import Dispatcher
from guard.config import GuardConfig
from guard.metrics import GuardMetrics
from guard.plan.live import LivePlanner, Reading
from guard.pool.pool import ReplicaPool
from guard.state.shared import SharedState

# Outcomes of requests the pool did not take: refused for want of capacity, or served by a fallback. They
# are demand all the same, and the arrival rate counts them.
SHED_OUTCOMES = frozenset({"rejected_overload", "fallback"})


class Guard(Protocol):
    """What the signals read of a guard instance."""

    config: GuardConfig
    pool: ReplicaPool
    dispatcher: Dispatcher
    metrics: GuardMetrics
    shared: SharedState | None


def read(guard: Guard, now: float) -> Reading:
    metrics, pool = guard.metrics, guard.pool
    admitted = sum(metrics.child(metrics.routed, replica.name).get() for replica in pool)
    shed = sum(sample.value for family in metrics.requests.collect() for sample in family.samples
               if sample.name.endswith("_total") and sample.labels["outcome"] in SHED_OUTCOMES)
    serving = [replica for replica in pool.up() if replica.gate.budget > 0]
    return Reading(
        time=now, admitted_total=admitted, shed_total=shed,
        queued=guard.dispatcher.fair.queued, queued_blocks=guard.dispatcher.blocks_queued(),
        in_flight=sum(replica.in_flight for replica in pool),
        reserved_blocks=sum(replica.gate.reserved for replica in pool),
        committed_blocks=sum(replica.gate.committed() for replica in serving),
        budget_blocks=sum(replica.gate.budget for replica in serving), replicas=len(serving),
        guards=guard.shared.live_guards if guard.shared is not None else 1)


def max_wait_s(config: GuardConfig) -> float:
    """The queueing wait to plan for: ``wait_share`` of the tightest TTFT objective among the lanes that the
    tenants use, or ``max_wait_s`` when none of them has one."""
    objectives = [slo.ttft_ms for tenant in config.tenants
                  if (slo := config.lanes[tenant.lane].slo) is not None and slo.ttft_ms is not None]
    scaling = config.autoscaling
    return min(objectives) / 1000 * scaling.wait_share if objectives else scaling.max_wait_s


async def publish(guard: Guard) -> None:
    """Runs until cancelled (with the guard's other background tasks)."""
    scaling = guard.config.autoscaling  # read at start-up only: a reload may not change it
    planner = LivePlanner(scaling.window_s, scaling.scale_down_delay_s, scaling.min_replicas, scaling.max_replicas)
    desired = guard.metrics.desired_replicas.labels(scaling.pool)
    saturation = guard.metrics.pool_saturation.labels(scaling.pool)
    desired.set(planner.desired)
    while True:
        signals = planner.update(read(guard, time.monotonic()), max_wait_s(guard.config))
        desired.set(signals.desired)
        saturation.set(signals.saturation)
        await asyncio.sleep(scaling.interval_s)
