"""The planner's queueing model on live numbers: how many engine replicas the pool should have now, and how
close to full it is. The autoscaling signals ``guard_desired_replicas{pool}`` and ``guard_saturation{pool}``
(guard/server/autoscale.py reads the guard into a `Reading` every ``interval_s`` and publishes `Signals`).

What ``python -m guard.plan`` takes from a workload file is measured here instead, over the last
``window_s`` of readings:

- arrival rate: requests that reached the pool's admission per second: admitted to a replica, refused for
  capacity or sent to a fallback, or still waiting (the queue's growth), times the guards that share the
  pool (each sees its load balancer's share);
- service time: how long an admitted request holds its place, by Little's law (mean requests running over
  the admission rate);
- stream slots per replica: a replica's admission budget over the mean blocks a running request holds;
- the wait target: ``max_wait_s`` given by the caller (the lanes' TTFT objectives, guard/server/autoscale.py).

The raw count is the planner's rule (guard/plan/planner.py): the larger of the replicas whose budgets hold
what is committed and queued now, and the fewest replicas whose Erlang-C mean wait meets the target, within
``[min_replicas, max_replicas]``. The published count has hysteresis, the HPA's scale-down stabilization: it
rises with the raw count at once and falls only to the highest raw count of the last
``scale_down_delay_s``, so a raw count that wavers between two values publishes the higher one.

Invariants: ``min_replicas <= desired <= max_replicas`` (when set); ``0 <= saturation <= 1``; a reading
without telemetry (no budget) changes no estimate and publishes the last desired count.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from guard.plan.queueing import replicas_for_wait


@dataclass(slots=True, frozen=True)
class Reading:
    """The guard's pool at one instant. Totals only grow (a guard's counters); the rest are levels."""

    time: float  # monotonic seconds
    admitted_total: float  # requests admitted to a replica so far
    shed_total: float  # requests the pool did not take so far: refused for capacity, or sent to a fallback
    queued: int  # requests waiting in the guard's queue
    queued_blocks: int  # the KV blocks they will reserve
    in_flight: int  # requests running on the replicas
    reserved_blocks: int  # the KV blocks reserved for them
    committed_blocks: int  # blocks held on the replicas that are up: reserved, and used by other traffic
    budget_blocks: int  # blocks the guard may commit on the replicas that are up (0 without telemetry)
    replicas: int  # replicas that are up with a budget
    guards: int = 1  # guards sharing the pool (shared_state), each seeing its share of the arrivals


@dataclass(slots=True, frozen=True)
class Signals:
    """What is published (``desired``, ``saturation``) and what it was computed from, for tests and logs."""

    desired: int
    saturation: float
    raw: int | None  # this reading's count before hysteresis; None when it had no telemetry
    arrival_rate: float  # requests per second, all guards
    service_s: float | None  # mean time an admitted request holds its slot
    slots_per_replica: int | None


# Without max_replicas, the count the queueing model may ask for: bounds its search (queueing.replicas_for_wait)
# on a reading of a huge arrival rate or service time, which once held the guard's event loop for seconds.
SEARCH_LIMIT = 1024

class LivePlanner:
    """Feed it a `Reading` every few seconds (`update`); it answers the `Signals` of the pool."""

    def __init__(self, window_s: float, scale_down_delay_s: float, min_replicas: int = 1,
                 max_replicas: int | None = None) -> None:
        if max_replicas is not None and max_replicas < min_replicas:
            raise ValueError(f"max_replicas {max_replicas} < min_replicas {min_replicas}")
        self.window_s = window_s
        self.scale_down_delay_s = scale_down_delay_s
        self.min_replicas, self.max_replicas = min_replicas, max_replicas
        self.readings: deque[Reading] = deque()
        self.recommendations: deque[tuple[float, int]] = deque()  # (time, raw) over scale_down_delay_s
        self.desired = min_replicas
        # Kept from the last window that measured them: an idle window measures neither.
        self.service_s: float | None = None
        self.blocks_per_request: float | None = None

    def update(self, reading: Reading, max_wait_s: float) -> Signals:
        self._remember(reading)
        rate = self._arrival_rate()
        self._measure()
        slots = self._slots(reading)
        raw = self._raw(reading, rate, slots, max_wait_s)
        if raw is not None:
            self._stabilize(reading.time, raw)
        return Signals(self.desired, self._saturation(reading, rate, slots), raw, rate, self.service_s, slots)

    # -- measurements over the window --------------------------------------------------------------------
    def _remember(self, reading: Reading) -> None:
        self.readings.append(reading)
        # Keep one reading at or before the window's start, so the window spans window_s once it can.
        while len(self.readings) > 2 and self.readings[1].time <= reading.time - self.window_s:
            self.readings.popleft()

    def _span(self) -> float:
        return self.readings[-1].time - self.readings[0].time

    def _arrival_rate(self) -> float:
        if (span := self._span()) <= 0:
            return 0.0
        first, last = self.readings[0], self.readings[-1]
        arrived = (last.admitted_total - first.admitted_total + last.shed_total - first.shed_total
                   + last.queued - first.queued)
        return max(0.0, arrived) / span * last.guards

    def _measure(self) -> None:
        """Service time and blocks per request from the window, time-weighted (each reading stands for the
        interval before it). Left as they were when the window admitted nothing or ran nothing."""
        pairs = list(zip(self.readings, list(self.readings)[1:]))
        running = math.fsum(b.in_flight * (b.time - a.time) for a, b in pairs)
        blocks = math.fsum(b.reserved_blocks * (b.time - a.time) for a, b in pairs)
        admitted = self.readings[-1].admitted_total - self.readings[0].admitted_total
        if admitted > 0 and running > 0:
            self.service_s = running / admitted  # Little: (mean running x span) / (admission rate x span)
        if running > 0:
            self.blocks_per_request = blocks / running

    def _slots(self, reading: Reading) -> int | None:
        if reading.replicas == 0 or reading.budget_blocks == 0 or not self.blocks_per_request:
            return None
        return max(1, math.floor(reading.budget_blocks / reading.replicas / self.blocks_per_request))

    # -- the count -----------------------------------------------------------------------------------------
    def _raw(self, reading: Reading, rate: float, slots: int | None, max_wait_s: float) -> int | None:
        if reading.replicas == 0 or reading.budget_blocks == 0:
            return None
        per_replica = reading.budget_blocks / reading.replicas
        count = max(self.min_replicas, math.ceil((reading.committed_blocks + reading.queued_blocks) / per_replica))
        if rate > 0 and slots is not None and self.service_s is not None:
            limit = self.max_replicas or SEARCH_LIMIT
            count = max(count, replicas_for_wait(slots, rate, self.service_s, max_wait_s, limit))
        return count if self.max_replicas is None else min(count, self.max_replicas)

    def _stabilize(self, now: float, raw: int) -> None:
        self.recommendations.append((now, raw))
        while self.recommendations[0][0] < now - self.scale_down_delay_s:
            self.recommendations.popleft()
        self.desired = max(count for _, count in self.recommendations)

    def _saturation(self, reading: Reading, rate: float, slots: int | None) -> float:
        """The fuller of the pool's KV budget (committed and queued blocks over it) and its stream slots
        (offered load over the slots of the replicas that are up), capped at 1. No budget: 1 while anything
        asks for the pool, else 0."""
        if reading.budget_blocks == 0:
            return 1.0 if reading.queued or reading.in_flight or rate > 0 else 0.0
        kv = (reading.committed_blocks + reading.queued_blocks) / reading.budget_blocks
        offered = rate * self.service_s / (reading.replicas * slots) if slots and self.service_s else 0.0
        return min(1.0, max(kv, offered))
