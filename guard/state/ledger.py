"""The admission backend of guards that share state: one KV ledger per engine and one VTC order across
every guard, in Redis (guard/state/scripts.py ``admit``), behind guard/admission/backend.py's ``Ledger``.
The dispatcher (guard/admission/dispatch.py) is the same one a guard alone runs: it ranks, lends and orders
the queue; the ledger only decides, in one atomic step over every live guard:

- fairness: the ticket's tenant has the lowest virtual counter among the tenants queued at any guard (up to
  ``SLACK_TOKENS`` of service), so a tenant flooding one guard and another flooding a second are served in
  proportion to their weights, as if they were queued at one guard;
- room: the sum of every guard's reservations on the replica, with this one, stays within the limits this
  guard reads from the replica's telemetry (the same rule as the gate, borrowing included).

Counters are charged at admission for the input and the reserved output, and settled when the request ends
(output not generated is refunded), so nothing accumulates error. Queued tickets are counted in Redis per
tenant and guard (the global backlog VTC needs), in order, on the link's wire with everything else.

While the link is down (``SharedState.up`` False) every decision is the dispatcher's own, each gate scaled
to this guard's share of its engine, less what the other guards held beyond theirs as the ledger last said
(every ledger answer and lease renewal tells, guard/pool/gate.py ``mine``): every path that commits blocks,
a first admission, a failover's re-admission, a batch of prompts or a growing reservation, goes through
those gates, and what was admitted before the outage counts in them. Tickets admitted then are in the
holdings the link writes back when Redis returns. Reservations do not grow while the link is up (a stream
that outgrows its predicted output runs on and the engine bounds it): growing would need a round trip on
every token past the prediction. A tenant's guarantee is read from this guard's own reservations: a tenant
served by several guards may hold its guarantee at each, while the ledger still keeps the guaranteed part of
every engine within its budget.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from guard.admission import slo
from guard.admission.backend import Admitting, Reserved
from guard.admission.fairness import INPUT_COST, OUTPUT_COST
from guard.admission.ticket import Ticket, TicketState
from guard.pool.pool import ReplicaPool
from guard.pool.scheduling import Candidate
from guard.state.shared import Holdings, SharedState
from guard.state.sightings import Held, Sightings

SLACK_TOKENS = 64.0  # weighted service a tenant may be ahead of the lowest backlogged one and still go first
CRITICAL_SLACK = 1e18  # a critical ticket's: its turn whatever the counters say


class RedisLedger:
    def __init__(self, shared: SharedState, pool: ReplicaPool) -> None:
        self.shared = shared
        self.pool = pool
        self.dispatcher: Admitting | None = None
        self.sightings = Sightings()  # what the other guards held, for the gates' share while the link is down

    @property
    def up(self) -> bool:
        return self.shared.up

    @property
    def stopping(self) -> bool:
        return self.shared.stopping

    def attach(self, dispatcher: Admitting) -> None:
        self.dispatcher = dispatcher
        dispatcher.fair.on_backlog = lambda tenant, delta: self.shared.send("BACKLOG", tenant, delta)
        self.shared.holdings = self.holdings
        self.shared.on_change = self._link_changed
        self.shared.on_others = self._others_hold

    def holdings(self) -> Holdings:
        assert self.dispatcher is not None
        ledger = {r.name: (r.gate.reserved, r.gate.borrowed) for r in self.pool}
        return ledger, {name: len(queue) for name, queue in self.dispatcher.fair.tenants.items() if len(queue)}

    def _others_hold(self, others: dict[str, Held]) -> None:
        self.sightings.renewed(others)

    def _link_changed(self, up: bool) -> None:
        share = 1.0 if up else 1.0 / self.shared.live_guards
        for replica in self.pool:
            replica.gate.share = share
            if not up:  # nothing is sighted while down: the gate keeps to what was seen before
                replica.gate.others = self.sightings.peak(replica.name)
        if self.dispatcher is not None:
            self.dispatcher.pump()

    async def reserve(self, tenant: str, ticket: Ticket, ranked: Sequence[Candidate],
                      placed: Callable[[Candidate], None]) -> Reserved:
        charge = (INPUT_COST * ticket.prompt_tokens + OUTPUT_COST * ticket.max_tokens) / ticket.tenant.weight
        # The priority band goes before fairness (guard/admission/dispatch.py ``_next_tenant``): a critical
        # ticket is never told it is another tenant's turn.
        slack = CRITICAL_SLACK if ticket.priority_class == slo.CRITICAL else SLACK_TOKENS / ticket.tenant.weight
        for candidate in ranked:
            threshold_room, pool_room = candidate.replica.gate.rooms(ticket.borrowed)
            deciding = self.shared.ask(
                "ADMIT", candidate.replica.name, tenant, ticket.blocks, ticket.borrowed, threshold_room, pool_room,
                charge, slack,
                on_answer=lambda answer, c=candidate: self._answered(tenant, ticket, c, placed, answer))
            try:
                answer = await asyncio.shield(deciding)
            except asyncio.CancelledError:  # what the ledger grants is given back as soon as it answers
                deciding.add_done_callback(lambda _: ticket.replica is not None and self.release(ticket))
                raise
            if answer is None:
                return "down"
            if answer[0] == 1:
                return "admitted"
            if answer[1] == "fair":
                return "fair"
        return "full"

    def _answered(self, tenant: str, ticket: Ticket, candidate: Candidate, placed: Callable[[Candidate], None],
                  answer: list | None) -> None:
        """The ledger's answer, the moment it arrives: a grant is recorded on the replica's gate at once, so
        that no resync can write back holdings without it. Any answer with room in it says what the other
        guards hold there now."""
        if answer is None or answer[0] != 1 and answer[1] == "fair":
            return  # no answer, or not the tenant's turn: nothing said about the replica's room
        gate = candidate.replica.gate
        self.sightings.saw(candidate.replica.name, answer[-1])
        gate.decided(answer[0] == 1, ticket.borrowed)  # the gate's hysteresis, as its own try_reserve keeps it
        if answer[0] == 1:
            gate.record(ticket.request_id, tenant, ticket.blocks, ticket.borrowed)
            placed(candidate)

    def release(self, ticket: Ticket) -> None:
        """Give the ticket's blocks back in the ledger and settle its tenant's counter to what it generated
        (the gate is released by the dispatcher for an admitted ticket; here for one the ledger admitted
        after it left)."""
        assert ticket.replica is not None
        refund = OUTPUT_COST * (ticket.output_tokens - ticket.max_tokens) / ticket.tenant.weight
        self.shared.send("RELEASE", ticket.replica.name, ticket.blocks, ticket.borrowed, ticket.tenant.name, refund)
        if ticket.state is not TicketState.ADMITTED:  # admitted by the ledger after it left: undo it here too
            ticket.replica.gate.release(ticket.request_id)
            ticket.replica.finished()
