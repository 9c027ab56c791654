"""Tenant-fair queueing with Virtual Token Counters (Sheng et al., OSDI 2024).

A tenant's *service* is its tokens weighted by cost, ``input + 2 * output``; its virtual counter is that
service divided by the tenant's weight. The next
admission goes to the backlogged tenant with the lowest counter. A tenant that becomes backlogged after
idling is lifted to the lowest counter among the backlogged tenants, so idle time banks no credit.
Inside a tenant, an order key orders the work (lower first: the dispatcher's is the request's class, then
its lane's priority), FIFO within a key.

Invariant: a tenant is *backlogged* iff it has at least one queued item; only backlogged tenants compete.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

INPUT_COST = 1.0
OUTPUT_COST = 2.0
JAIN_WINDOW_S = 30.0  # the longest window the fairness index looks back over

Item = TypeVar("Item")
Order = int | tuple[int, ...]  # what orders the work inside a tenant: lower first


@dataclass(slots=True)
class TenantQueue(Generic[Item]):
    name: str
    weight: float
    counter: float = 0.0  # virtual token counter: service / weight, lifted after idling
    service: float = 0.0  # input + 2 * output tokens actually served, never lifted
    lanes: dict[Order, deque[Item]] = field(default_factory=dict)  # order key -> FIFO
    queued: int = 0  # items in all lanes; changed only by FairQueue's push, pop and remove (as is its total)

    def __len__(self) -> int:
        return self.queued

    def head(self) -> Item | None:
        for priority in sorted(self.lanes):
            if self.lanes[priority]:
                return self.lanes[priority][0]
        return None


class FairQueue(Generic[Item]):
    def __init__(self) -> None:
        self.tenants: dict[str, TenantQueue[Item]] = {}
        self.queued = 0  # items queued over all tenants
        # Told (tenant, +1 or -1) of every item queued and unqueued: guards that share state keep a global
        # backlog with it (guard/state/ledger.py).
        self.on_backlog: Callable[[str, int], None] | None = None
        # Weighted service per whole second of the clock, (second, {tenant: service / weight}), over the last
        # JAIN_WINDOW_S: one entry per second, not per charge, so a busy guard's window stays small.
        self._service_log: deque[tuple[int, dict[str, float]]] = deque()

    def tenant(self, name: str, weight: float) -> TenantQueue[Item]:
        queue = self.tenants.get(name)
        if queue is None:
            queue = self.tenants[name] = TenantQueue(name, weight)
        return queue

    def drop(self, name: str) -> None:
        """Forget a tenant with nothing queued (a reload removed it): its counters go with it, and a tenant
        of that name added later starts afresh, lifted like any tenant back from idle."""
        if len(self.tenants[name]):
            raise ValueError(f"tenant {name!r} still has items queued")
        del self.tenants[name]

    def backlogged(self) -> Iterator[TenantQueue[Item]]:
        return (t for t in self.tenants.values() if len(t))

    def push(self, tenant: TenantQueue[Item], lane_priority: Order, item: Item) -> None:
        if not len(tenant):
            counters = [t.counter for t in self.backlogged()]
            if counters:
                tenant.counter = max(tenant.counter, min(counters))  # the idle-lift rule
        tenant.lanes.setdefault(lane_priority, deque()).append(item)
        tenant.queued += 1
        self.queued += 1
        if self.on_backlog is not None:
            self.on_backlog(tenant.name, 1)

    def remove(self, tenant: TenantQueue[Item], lane_priority: Order, item: Item) -> bool:
        """Drop a queued item (its client left, or its deadline passed). False if it was not queued."""
        lane = tenant.lanes.get(lane_priority)
        if lane is None or item not in lane:
            return False
        lane.remove(item)
        tenant.queued -= 1
        self.queued -= 1
        if self.on_backlog is not None:
            self.on_backlog(tenant.name, -1)
        return True

    @staticmethod
    def move(tenant: TenantQueue[Item], from_key: Order, to_key: Order, item: Item) -> None:
        """Move a queued item to the back of another of its tenant's lanes (nothing is queued or unqueued)."""
        tenant.lanes[from_key].remove(item)
        tenant.lanes.setdefault(to_key, deque()).append(item)

    def next_tenant(self, skip: set[str] | frozenset[str] = frozenset()) -> TenantQueue[Item] | None:
        """The backlogged tenant with the lowest counter (ties: the first configured), ``skip`` left out."""
        return min((t for t in self.backlogged() if t.name not in skip), key=lambda t: t.counter, default=None)

    def pop(self, tenant: TenantQueue[Item]) -> Item:
        for priority in sorted(tenant.lanes):
            if tenant.lanes[priority]:
                tenant.queued -= 1
                self.queued -= 1
                if self.on_backlog is not None:
                    self.on_backlog(tenant.name, -1)
                return tenant.lanes[priority].popleft()
        raise IndexError(f"tenant {tenant.name!r} has nothing queued")

    def charge(self, tenant: TenantQueue[Item], input_tokens: int = 0, output_tokens: int = 0) -> float:
        """Count service against the tenant; returns the service charged (``input + 2 * output``)."""
        service = INPUT_COST * input_tokens + OUTPUT_COST * output_tokens
        tenant.counter += service / tenant.weight
        tenant.service += service
        now = time.monotonic()
        second = int(now)
        if not self._service_log or self._service_log[-1][0] != second:
            self._service_log.append((second, {}))
            self._trim(now)  # here too, not only when the index is read: nobody may scrape for hours
        by_tenant = self._service_log[-1][1]
        by_tenant[tenant.name] = by_tenant.get(tenant.name, 0.0) + service / tenant.weight
        return service

    def _trim(self, now: float) -> None:
        while self._service_log and now - self._service_log[0][0] > JAIN_WINDOW_S:
            self._service_log.popleft()

    def jain_index(self, window_s: float = JAIN_WINDOW_S) -> float:
        """Jain's fairness index over the service per unit of weight that backlogged tenants got in the last
        window (to the second): 1.0 when service is exactly proportional to weight, 1/n when one tenant got
        everything. With fewer than two backlogged tenants there is nobody to be unfair to, so the index is 1.
        """
        now = time.monotonic()
        self._trim(now)
        names = {t.name for t in self.backlogged()}
        if len(names) < 2:
            return 1.0
        service = dict.fromkeys(names, 0.0)
        for second, by_tenant in self._service_log:
            if now - second <= window_s:
                for name in names:
                    service[name] += by_tenant.get(name, 0.0)
        values = list(service.values())
        total = sum(values)
        squares = sum(v * v for v in values)
        return total * total / (len(values) * squares) if squares > 0 else 1.0


def served_before(own: TenantQueue[Item], own_blocks: float, per_block: float,
                  others: list[tuple[TenantQueue[Item], float]], backlogged: bool) -> float:
    """Blocks VTC admits before the last of ``own_blocks`` of ``own``'s (its queued ones and a newcomer),
    of ``others``' queued ``(tenant, blocks)``: ``own``'s own, and of each other tenant what it is admitted
    while its counter is below the one ``own`` reaches with the newcomer's admission (a weighted fair queue's
    finish order), every block of service ``per_block`` (input + 2 x output tokens over its blocks). ``own``
    not ``backlogged`` is lifted to the lowest backlogged counter first, as ``push`` will lift it. An
    estimate: output is charged when a request ends, after later admissions, and counters move meanwhile."""
    counter = own.counter
    if not backlogged and others:
        counter = max(counter, min(tenant.counter for tenant, _ in others))
    level = counter + own_blocks * per_block / own.weight
    return own_blocks + sum(min(blocks, max(0.0, (level - tenant.counter) * tenant.weight / per_block))
                            for tenant, blocks in others)
