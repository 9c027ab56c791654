"""From queued to admitted: the fair queue in front of the admission gate.

``submit`` queues a ticket and waits until the dispatcher commits its reservation, or raises ``Rejected``;
while nobody waits, a ticket that fits is admitted at once without queueing (VTC has no one to order).
``pump`` admits tickets in VTC order: the backlogged tenant with the lowest counter goes first; a tenant at
its own block cap is passed over (its limit, not the pool's), but when the lowest eligible tenant's next
request does not fit the pool, admission stops there, so big requests are not starved by small ones.
``finish`` releases exactly once, however the request ended.

Invariant: a ticket is in exactly one state: queued (in the fair queue, no reservation), admitted (a
reservation, not queued) or done (neither).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass

from guard.admission.fairness import FairQueue, TenantQueue
from guard.admission.gate import AdmissionGate
from guard.config import GuardConfig, Lane, Tenant


class TicketState(enum.Enum):
    NEW = "new"
    QUEUED = "queued"
    ADMITTED = "admitted"
    DONE = "done"


@dataclass(slots=True, eq=False)
class Ticket:
    request_id: str
    tenant: Tenant
    lane: Lane
    prompt_tokens: int
    max_tokens: int
    blocks: int
    enqueued_at: float = 0.0
    state: TicketState = TicketState.NEW
    # Created only for a ticket that has to wait: most are admitted within submit and never need one.
    admitted: asyncio.Future[None] | None = None


class Rejected(Exception):
    """The guard refuses a request: ``status`` 429 (the tenant's limit) or 503 (capacity, deadline)."""

    def __init__(self, status: int, code: str, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after = retry_after


class Dispatcher:
    def __init__(self, config: GuardConfig, gate: AdmissionGate) -> None:
        self.config = config
        self.gate = gate
        self.block_caps: dict[str, float] = {}  # tenant -> share of the budget, tighter than its config
        self.closed: Rejected | None = None  # set by reject_all: what every later submit gets
        self.fair: FairQueue[Ticket] = FairQueue()
        for tenant in config.tenants:
            self.fair.tenant(tenant.name, tenant.weight)

    def queue_of(self, tenant: Tenant) -> TenantQueue[Ticket]:
        return self.fair.tenants[tenant.name]

    def blocks_queued(self) -> int:
        if not self.fair.queued:
            return 0  # the usual case, asked on every request
        return sum(t.blocks for q in self.fair.tenants.values() for lane in q.lanes.values() for t in lane)

    def blocks_ahead_of(self, ticket: Ticket) -> int:
        """Blocks queued that this ticket surely waits for: its own tenant's, in lanes served before or with
        its own. Other tenants' backlogs are not ahead of it: VTC serves the tenant with the least service."""
        queue = self.queue_of(ticket.tenant)
        return sum(t.blocks for priority, lane in queue.lanes.items() if priority <= ticket.lane.priority
                   for t in lane)

    async def submit(self, ticket: Ticket) -> None:
        """Queue ``ticket`` and wait for admission. Raises ``Rejected``; on cancellation nothing is held."""
        if self.closed is not None:
            raise self.closed
        queue = self.queue_of(ticket.tenant)
        if not self.fair.queued and self._within_cap(queue, ticket) and self.gate.try_reserve(
                ticket.request_id, queue.name, ticket.blocks):
            self._admitted(queue, ticket)  # nobody waits, so VTC order has nothing to say: no queue, no future
            return
        ahead = self.blocks_ahead_of(ticket) + ticket.blocks
        wait = self.gate.expected_wait(max(0, self.gate.committed() + ahead - self.gate.budget))
        if wait is not None and wait > ticket.lane.timeout:
            raise Rejected(503, "overloaded", f"the expected queueing time ({wait:.1f} s) exceeds this lane's "
                           f"timeout ({ticket.lane.timeout:g} s)", self.gate.retry_after(ahead))
        ticket.enqueued_at = time.monotonic()
        ticket.state = TicketState.QUEUED
        self.fair.push(queue, ticket.lane.priority, ticket)
        self.pump()
        if ticket.state is TicketState.QUEUED and len(queue) > ticket.tenant.max_queue:
            self._dequeue(ticket)  # max_queue counts waiting requests: one admitted at once never waited
            raise Rejected(429, "queue_full", f"tenant {ticket.tenant.name!r} already has {len(queue)} requests "
                           f"queued (max_queue {ticket.tenant.max_queue})", self.gate.retry_after(self.blocks_queued()))
        if ticket.state is TicketState.ADMITTED:
            return  # admitted at once by pump: no future, no deadline
        ticket.admitted = asyncio.get_running_loop().create_future()  # before any await: pump sets it
        try:
            await asyncio.wait_for(asyncio.shield(ticket.admitted), ticket.lane.timeout)
        except TimeoutError:
            self._dequeue(ticket)
            if ticket.state is TicketState.ADMITTED:  # admitted in the same instant the deadline passed
                return
            raise Rejected(503, "queue_timeout", f"not admitted within this lane's {ticket.lane.timeout:g} s "
                           "queueing timeout", self.gate.retry_after(self.blocks_queued())) from None
        except asyncio.CancelledError:
            self.finish(ticket)  # the client left: out of the queue, or its fresh reservation back
            raise

    def pump(self) -> None:
        """Admit as many queued tickets as the pool and the VTC order allow."""
        if not self.fair.queued:
            return  # the usual case after a release
        capped: set[str] = set()
        while (queue := self.fair.next_tenant(capped)) is not None:
            ticket = queue.head()
            assert ticket is not None
            if not self._within_cap(queue, ticket):
                capped.add(queue.name)
                continue
            if not self.gate.try_reserve(ticket.request_id, queue.name, ticket.blocks):
                return
            self.fair.pop(queue)
            self._admitted(queue, ticket)

    def _within_cap(self, queue: TenantQueue[Ticket], ticket: Ticket) -> bool:
        """The tenant's reservations may grow by this ticket (one request alone is always within its cap)."""
        held = self.gate.tenant_reserved(queue.name)
        cap = int(self.block_caps.get(queue.name, ticket.tenant.max_blocks_share) * self.gate.budget)
        return not held or held + ticket.blocks <= cap

    def _admitted(self, queue: TenantQueue[Ticket], ticket: Ticket) -> None:
        """The ticket's reservation is committed: charge its input and wake its request."""
        self.fair.charge(queue, input_tokens=ticket.prompt_tokens)
        ticket.state = TicketState.ADMITTED
        if ticket.admitted is not None:  # None while submit is admitting it itself
            ticket.admitted.set_result(None)

    def charge_output(self, ticket: Ticket, output_tokens: int) -> None:
        self.fair.charge(self.queue_of(ticket.tenant), output_tokens=output_tokens)

    def finish(self, ticket: Ticket) -> None:
        """End ``ticket`` in whatever state it is: dequeue or release its reservation. Idempotent."""
        if ticket.state is TicketState.QUEUED:
            self._dequeue(ticket)
        elif ticket.state is TicketState.ADMITTED:
            self.gate.release(ticket.request_id)
            self.pump()
        ticket.state = TicketState.DONE

    def reject_all(self, reason: Rejected) -> None:
        """Fail every queued ticket with ``reason``, and every later one (shutdown); admitted ones run on."""
        self.closed = reason
        for name in self.fair.tenants:
            self.reject_queued(name, reason)

    def reject_queued(self, tenant: str, reason: Rejected) -> int:
        """Fail the tenant's queued tickets with ``reason`` (admitted ones run on); returns how many."""
        queue = self.fair.tenants[tenant]
        rejected = 0
        while len(queue):
            ticket = self.fair.pop(queue)
            ticket.state = TicketState.DONE
            assert ticket.admitted is not None  # a queued ticket's submit created it before waiting
            ticket.admitted.set_exception(reason)
            rejected += 1
        return rejected

    def _dequeue(self, ticket: Ticket) -> None:
        if ticket.state is TicketState.QUEUED and self.fair.remove(self.queue_of(ticket.tenant),
                                                                    ticket.lane.priority, ticket):
            ticket.state = TicketState.DONE
