"""Admission for guards that share state: one KV budget per engine and one VTC order across every guard.

The fair queue, the tickets and their states are the ``Dispatcher``'s (guard/admission/dispatch.py); what
changes is who decides that a ticket may take blocks on a replica. Here it is the shared ledger in Redis
(guard/state/scripts.py ``admit``), one atomic step that checks, over every live guard:

- fairness: the ticket's tenant has the lowest virtual counter among the tenants queued at any guard (up to
  ``SLACK_TOKENS`` of service), so a tenant flooding one guard and another flooding a second are served in
  proportion to their weights, as if they were queued at one guard;
- room: the sum of every guard's reservations on the replica, with this one, stays within the limits this
  guard reads from the replica's telemetry (the same rule as the gate, borrowing included).

Admission is asynchronous: ``submit`` tries once when nobody waits here; otherwise the ticket queues and one
task admits the queue head by head (``pump`` only wakes it). A head that is not the tenant's turn passes to
the next local tenant; a head that finds no room stops the round (unless it borrows), and the round is tried
again when something here ends or after ``RETRY_S``, since other guards' releases send no word. Counters are
charged at admission for the input and the reserved output, and settled when the request ends (output not
generated is refunded), so nothing accumulates error. Queued tickets are counted in Redis per tenant and
guard (the global backlog VTC needs), in order, on the link's wire with everything else.

While the link is down (``SharedState.up`` False) everything is the ``Dispatcher``'s own, each gate scaled
to this guard's share of its engine, less what the other guards held beyond theirs as the ledger last said
(every ledger answer and lease renewal tells, guard/pool/gate.py ``mine``): every path that commits blocks,
a first admission, a failover's re-admission, a batch of prompts or a growing reservation, goes through
those gates, and what was admitted before the outage counts in them. Tickets admitted then are in the
holdings the link writes back when Redis returns. Reservations do not grow while the link is up (a stream
that outgrows its predicted output runs on and the engine bounds it): growing would need a round trip on
every token past the prediction.
A tenant's guarantee is read from this guard's own reservations: a tenant served by several guards may hold
its guarantee at each, while the ledger still keeps the guaranteed part of every engine within its budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Sequence

from guard.admission.dispatch import Dispatcher, Ticket, TicketState, ranking_request
from guard.admission.fairness import INPUT_COST, OUTPUT_COST, TenantQueue
from guard.config import GuardConfig
from guard.pool.pool import ReplicaPool
from guard.pool.scheduling import Candidate, Profile
from guard.state.shared import Holdings, SharedState

RETRY_S = 0.02  # how soon a blocked head is tried again: other guards' releases are not announced
SLACK_TOKENS = 64.0  # weighted service a tenant may be ahead of the lowest backlogged one and still go first


class SharedDispatcher(Dispatcher):
    def __init__(self, config: GuardConfig, pool: ReplicaPool, profile: Profile, shared: SharedState) -> None:
        super().__init__(config, pool, profile)
        self.shared = shared
        self._wake = asyncio.Event()
        # True while the admission task's round asks the ledger about a queued head: that head is still in
        # the queue, so a local pump now (the link went down meanwhile) could reserve it a second time.
        self._in_round = False
        self.fair.on_backlog = lambda tenant, delta: shared.send("BACKLOG", tenant, delta)
        shared.holdings = self.holdings
        shared.on_change = self._link_changed
        shared.on_others = self._others_hold

    def holdings(self) -> Holdings:
        ledger = {r.name: (r.gate.reserved, r.gate.borrowed) for r in self.pool}
        return ledger, {name: len(queue) for name, queue in self.fair.tenants.items() if len(queue)}

    def _others_hold(self, others: dict[str, list[int]]) -> None:
        for replica in self.pool:
            replica.gate.others = others.get(replica.name, [])

    def _link_changed(self, up: bool) -> None:
        share = 1.0 if up else 1.0 / self.shared.live_guards
        for replica in self.pool:
            replica.gate.share = share
        self.pump()

    # -- admission ---------------------------------------------------------------------------------------
    async def _place_now(self, queue: TenantQueue[Ticket], ticket: Ticket, budget: int | None = None) -> bool:
        if not self.shared.up:
            return self._place(queue, ticket, budget)  # (through the ledger, the budget is read after its answer)
        return await self._place_shared(queue, ticket) == "admitted"

    async def _place_shared(self, queue: TenantQueue[Ticket], ticket: Ticket) -> str:
        """Reserve through the ledger on the first replica, in the profile's order, with room: "admitted",
        "fair" (another tenant's turn, on every replica alike), "full", or "local" (Redis is down: the gates
        decided alone). Cancelled while the ledger decides (the client left), nothing stays reserved."""
        ticket.borrowed = borrowed = self._borrowed(ticket.tenant, ticket.blocks)
        charge = (INPUT_COST * ticket.prompt_tokens + OUTPUT_COST * ticket.max_tokens) / ticket.tenant.weight
        ranked = self.profile.rank(self.pool.replicas, ranking_request(ticket))
        for candidate in ranked:
            replica = candidate.replica
            threshold_room, pool_room = replica.gate.rooms()
            deciding = self.shared.ask("ADMIT", replica.name, queue.name, ticket.blocks, borrowed, threshold_room,
                                       pool_room, charge, SLACK_TOKENS / ticket.tenant.weight,
                                       on_answer=functools.partial(self._granted, queue, ticket, candidate, ranked))
            try:
                answer = await asyncio.shield(deciding)
            except asyncio.CancelledError:  # what the ledger grants is given back as soon as it answers
                deciding.add_done_callback(lambda _: ticket.replica is not None and self._release(ticket))
                raise
            if answer is None:
                return "admitted" if self._place(queue, ticket) else "local"
            if answer[0] == 1:
                return "admitted"
            if answer[1] == "fair":
                return "fair"
        return "full"

    def _granted(self, queue: TenantQueue[Ticket], ticket: Ticket, candidate: Candidate,
                 ranked: Sequence[Candidate], answer: list | None) -> None:
        """The ledger's answer, the moment it arrives: a grant is recorded on the replica's gate at once, so
        that no resync can write back holdings without it; the ticket keeps the ranking that admitted it.
        Any answer with room in it says what the other guards hold there now."""
        if answer is not None and len(answer) > 1 and answer[-1] != "fair":
            candidate.replica.gate.others = list(answer[-1].values() if isinstance(answer[-1], dict) else answer[-1])
        if answer is not None and answer[0] == 1:
            replica = candidate.replica
            replica.gate.record(ticket.request_id, queue.name, ticket.blocks, ticket.borrowed)
            ticket.replica, ticket.hit_blocks, ticket.candidates = replica, candidate.hit_blocks, ranked
            replica.admitted()

    def pump(self) -> None:
        if self.shared.up or self._in_round:
            self._wake.set()  # the admission task asks the ledger (a pump cannot wait for Redis), or pumps
        else:
            super().pump()

    async def run(self) -> None:
        """The admission task: admit queued tickets through the ledger, whenever anything may have changed."""
        while not self.shared.stopping:
            await self._wake.wait()
            self._wake.clear()
            while self.fair.queued and self.shared.up and not await self._round():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), RETRY_S)
                self._wake.clear()
            if not self.shared.up:
                super().pump()  # the link went down during a round: the gates decide alone from here

    async def _round(self) -> bool:
        self._in_round = True
        try:
            return await self._admit_round()
        finally:
            self._in_round = False

    async def _admit_round(self) -> bool:
        """Admit heads in VTC order until one finds no room; True when the queue emptied."""
        passed: set[str] = set()
        while (queue := self.fair.next_tenant(passed)) is not None:
            ticket = queue.head()
            assert ticket is not None
            if not self._within_cap(queue, ticket):
                passed.add(queue.name)
                continue
            outcome = await self._place_shared(queue, ticket)
            if ticket.state is not TicketState.QUEUED:  # it left (or timed out) while the ledger was asked
                if outcome == "admitted":
                    self._release(ticket)
                continue
            if outcome == "admitted":
                self.fair.remove(queue, ticket.lane.priority, ticket)
                self._admitted(queue, ticket)
            elif outcome == "fair" or ticket.borrowed:
                passed.add(queue.name)
            else:
                return False
        return not self.fair.queued

    # -- the end of a request ----------------------------------------------------------------------------
    def stop(self) -> None:
        """End the admission task (with the link: shutdown)."""
        self.shared.stop()
        self._wake.set()

    def grow(self, ticket: Ticket, blocks: int, max_tokens: int) -> bool:
        return False if self.shared.up else super().grow(ticket, blocks, max_tokens)

    def finish(self, ticket: Ticket) -> None:
        if ticket.state is TicketState.ADMITTED:
            self._release(ticket)
        super().finish(ticket)

    def _release(self, ticket: Ticket) -> None:
        """Give the ticket's blocks back in the ledger and settle its tenant's counter to what it generated
        (the local gate is released by ``finish``)."""
        assert ticket.replica is not None
        refund = OUTPUT_COST * (ticket.output_tokens - ticket.max_tokens) / ticket.tenant.weight
        self.shared.send("RELEASE", ticket.replica.name, ticket.blocks, ticket.borrowed, ticket.tenant.name,
                         refund)
        if ticket.state is not TicketState.ADMITTED:  # admitted by the ledger after it left: undo it here too
            ticket.replica.gate.release(ticket.request_id)
            ticket.replica.finished()
