"""Erlang-C (M/M/c): the chance a request waits for a server, and its mean wait, for ``c`` servers.

A *server* here is one concurrent stream slot: a place in the KV safe envelope for one sequence of the
workload's mean p95 size (sizing.py counts them per replica). A request holds its slot from admission to its
last token, so ``mean_service_s`` is that time, measured at the load being planned: under continuous
batching a slot's speed depends on how many slots are busy, which M/M/c does not model.

Computed through the Erlang-B recursion, ``B(0) = 1``, ``B(k) = a B(k-1) / (k + a B(k-1))``, then
``C = c B / (c - a (1 - B))``: no factorials or powers, so it stays exact to float precision for thousands
of servers where ``a**c / c!`` overflows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class QueueRow:
    """The queue of a fleet of ``replicas`` replicas; unstable (``utilization >= 1``): every request waits and
    the mean wait grows without bound (``math.inf``)."""

    replicas: int
    servers: int
    utilization: float
    p_wait: float
    mean_wait_s: float


def erlang_c(servers: int, offered: float) -> float:
    """P(wait > 0) for ``offered`` Erlangs (arrival rate x mean service time) on ``servers`` servers; 1 when
    the queue is unstable (``offered >= servers``)."""
    if servers <= 0 or offered >= servers:
        return 1.0
    if offered <= 0:
        return 0.0
    blocking = 1.0
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    return servers * blocking / (servers - offered * (1.0 - blocking))


def mean_wait(servers: int, offered: float, mean_service_s: float) -> float:
    """Mean queue wait, in seconds, over all requests (those that never wait included)."""
    if offered >= servers:
        return math.inf
    return erlang_c(servers, offered) * mean_service_s / (servers - offered)


def queue_row(replicas: int, slots_per_replica: int, rate_per_s: float, mean_service_s: float) -> QueueRow:
    servers = replicas * slots_per_replica
    offered = rate_per_s * mean_service_s
    return QueueRow(replicas, servers, offered / servers, erlang_c(servers, offered),
                    mean_wait(servers, offered, mean_service_s))


def replicas_for_wait(slots_per_replica: int, rate_per_s: float, mean_service_s: float, max_wait_s: float,
                      limit: int | None = None) -> int:
    """The fewest replicas whose mean queue wait is at most ``max_wait_s``, or ``limit`` if that is fewer.
    Starts at the fewest that are stable; the wait falls with every server added and tends to 0, so the
    search ends. Erlang B's recursion runs once over the servers, extended by one replica's slots per step
    (not again from 1 for every count tried): O(servers), and O(limit x slots) at most with a limit, which
    the guard's live signal sets (guard/plan/live.py), so that a huge reading never stalls its event loop.
    The recursion stops where the blocking probability underflows to 0 (it stays 0 after): a replica of
    millions of slots (a large KV budget over small requests) costs the offered load plus a few hundred
    steps, not its slots (it held the guard's loop about a second per reading)."""
    offered = rate_per_s * mean_service_s
    replicas = max(1, math.floor(offered / slots_per_replica) + 1)
    if limit is not None and replicas >= limit:
        return limit
    servers, blocking = 0, 1.0
    while True:
        for k in range(servers + 1, replicas * slots_per_replica + 1):
            blocking = offered * blocking / (k + offered * blocking)
            if blocking == 0.0:  # underflowed: 0.0 for every server after (see above)
                break
        servers = replicas * slots_per_replica
        waiting = 0.0 if offered <= 0 else servers * blocking / (servers - offered * (1.0 - blocking))
        if waiting * mean_service_s / (servers - offered) <= max_wait_s or replicas == limit:
            return replicas
        replicas += 1
