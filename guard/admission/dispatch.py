"""From queued to admitted: one fair queue for the whole pool, in front of the replicas' admission gates.

``submit`` queues a ticket and waits until the dispatcher commits its reservation on a replica, or raises
``GuardError``; while nobody waits, a ticket that fits somewhere is admitted at once without queueing (VTC
has no one to order). ``pump`` admits tickets in VTC order: the backlogged tenant with the lowest counter
goes first, to the first replica in its scheduling profile's order whose gate admits it
(guard/pool/scheduling/); a
tenant at its own block cap is passed over (its limit, not the pool's), but when the lowest eligible
tenant's next request fits no replica, admission stops there, so big requests are not starved by small
ones. ``finish`` releases exactly once, however the request ended.

Guaranteed shares and borrowing (the default, attack-safe without any ``max_blocks_share``): each tenant is
guaranteed ``weight / total weight`` of the pool's budget. What a ticket reserves beyond its tenant's
guarantee is *borrowed* from idle capacity: it must fit the gate whole, it runs at a lower engine priority
(``BORROWED_PRIORITY``, so the engine preempts borrowers first), and a borrowing ticket that does not fit is
passed over like a capped one, never holding up a tenant within its guarantee. A ticket within its
guarantee reclaims borrowed blocks (guard/pool/gate.py). A tenant alone may borrow the whole budget.

``revoke`` takes the pool back from a tenant at once (a confirmed attacker): its admitted tickets are told
why through ``Ticket.on_revoke``, which ends their upstream requests; their reservations are released as
they end, as any other's.

Invariant: a ticket is in exactly one state: queued (in the fair queue, no reservation), admitted (a
reservation on exactly one replica, ``ticket.replica``, not queued) or done (neither).

With shared state the same dispatcher decides: the ranking, the lending and the queue's order are this
module's; the ledger (guard/admission/backend.py ``Ledger``, in Redis: guard/state/ledger.py) only says
whether a reservation fits among every guard's and whose VTC turn it is across guards. Its answers take a
round trip, so the one admission round (``_admission``) is then driven by a task (``run``) instead of within
``pump``; while Redis is down the gates decide, as for a guard alone.

A reload (``reconfigure``) changes what later requests get; a ticket keeps the ``Tenant`` and ``Lane`` it
was made with. A tenant the reload removed is *retired*: its queued tickets are still admitted in VTC order,
its admitted ones run on, and its queue is dropped once it has nothing queued or reserved. The gates count
as the guard's own exactly the tenants with a queue here, retired ones included: while a retired tenant's
requests run, their engine blocks are covered by its reservations, not traffic from outside the guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import Generator, Sequence

from guard.admission import slo
from guard.admission.backend import Ledger
from guard.admission.fairness import INPUT_COST, OUTPUT_COST, FairQueue, TenantQueue, served_before
from guard.admission.ticket import Ticket, TicketState
from guard.config import GuardConfig, Tenant
from guard.errors import GuardError
from guard.pool.gate import engine_priority
from guard.pool.pool import ReplicaPool
from guard.pool.scheduling import Candidate, Profiles, Request


def ranking_request(ticket: Ticket) -> Request:
    """The ticket as the scheduling profile ranks for it now: what its TTFT objective leaves after its wait
    so far, its TPOT objective, and the engine priority its borrowing gives it."""
    objective = ticket.objective
    ttft_left = None if objective is None or objective.ttft_s is None else \
        objective.ttft_s - (time.monotonic() - ticket.arrived)
    return Request(ticket.blocks, ticket.hashes, ticket.prompt_tokens, ttft_left,
                   None if objective is None else objective.tpot_s,
                   engine_priority(ticket.lane.priority, ticket.borrowed), ticket.lora, ticket.tenant.name,
                   ticket.model, ticket.objective_name, ticket.priority_class == slo.SHEDDABLE)


RETRY_S = 0.02  # with a ledger: how soon a blocked head is tried again (other guards' releases send no word)

# What the admission round does with the queue head it offers (``Dispatcher._admission``): admitted on a
# replica; "fair": another tenant's turn (the ledger's VTC order across guards); "full": no room; "gone": it
# left while the ledger was asked.
Placed = str


class Dispatcher:
    def __init__(self, config: GuardConfig, pool: ReplicaPool, profile: Profiles, ledger: Ledger | None = None) -> None:
        self.config = config
        self.pool = pool
        self.profile = profile
        self.block_caps: dict[str, float] = {}  # tenant -> share of the budget, tighter than its config
        self.closed: GuardError | None = None  # set by reject_all: what every later submit gets
        self.fair: FairQueue[Ticket] = FairQueue()
        self.retired: set[str] = set()  # tenants a reload removed that still have a queue here
        self.running: dict[str, set[Ticket]] = {}  # tenant -> its admitted tickets, for revoke
        self.sheddable_held = 0  # blocks the admitted sheddable tickets reserve (``_not_waited_for``)
        self.departures = slo.Departures()  # the queue's pace, which predicts a newcomer's wait
        self.correction = slo.WaitCorrection()  # and how the waits predicted from it turned out
        self.total_weight = sum(tenant.weight for tenant in config.tenants)  # of the running config's tenants
        for tenant in config.tenants:
            self.fair.tenant(tenant.name, tenant.weight)
        # Until when the replicas' latency models are kept (``_admitted``): always where the config sets an
        # objective, else for ``slo.PREDICTING_S`` after the last request an X-SLO-* header gave one.
        self.predicting_until = math.inf if slo.configured(config) else 0.0
        # Where reservations are decided: the replicas' gates in this process, or, with shared state, a
        # ledger every guard shares (guard/state/ledger.py), the gates deciding while it is down.
        self.ledger = ledger
        self._wake = asyncio.Event()  # with a ledger: the admission task has something to try
        # True while the admission task asks the ledger about a queued head: that head is still in the
        # queue, so a local pump now (the link went down meanwhile) could reserve it a second time.
        self._in_round = False
        if ledger is not None:
            ledger.attach(self)

    def reconfigure(self, config: GuardConfig) -> None:
        """Take a reloaded configuration: a new tenant gets a queue, a kept one its new weight (for service
        from now on: its counter keeps what it was charged), a removed one is retired."""
        self.config = config
        self.total_weight = sum(tenant.weight for tenant in config.tenants)
        for tenant in config.tenants:
            self.fair.tenant(tenant.name, tenant.weight).weight = tenant.weight
        if slo.configured(config):
            self.predicting_until = math.inf
        elif self.predicting_until == math.inf:  # the objectives went: kept as long as after a header's
            self.predicting_until = time.monotonic() + slo.PREDICTING_S
        self.retired = set(self.fair.tenants) - {t.name for t in config.tenants}
        self._drop_idle_retired()

    def queue_of(self, tenant: Tenant) -> TenantQueue[Ticket]:
        queue = self.fair.tenants.get(tenant.name)
        if queue is None:  # authenticated before a reload removed its tenant, whose queue has gone since
            queue = self.fair.tenant(tenant.name, tenant.weight)
            self.retired.add(tenant.name)
            self._count_as_ours()
        return queue

    def blocks_queued(self, priority_class: str | None = None) -> int:
        """Blocks of the queued tickets (of ``priority_class`` only, when given)."""
        if not self.fair.queued:
            return 0  # the usual case, asked on every request
        return sum(t.blocks for q in self.fair.tenants.values() for lane in q.lanes.values() for t in lane
                   if priority_class is None or t.priority_class == priority_class)

    def blocks_ahead_of(self, ticket: Ticket) -> int:
        """Blocks queued that this ticket surely waits for: its own tenant's, of the classes and lanes served
        before or with its own (``Ticket.order``). Other tenants' backlogs are not ahead of it: VTC serves the
        tenant with the least service."""
        queue = self.queue_of(ticket.tenant)
        order = ticket.order
        return sum(t.blocks for key, lane in queue.lanes.items() if key <= order for t in lane)

    def blocks_before(self, ticket: Ticket) -> slo.Backlog:
        """What is queued to be admitted before the ticket, by its class: a critical one (on time: it is
        being judged) waits only for the critical tickets that can still be on time (they go first, the late
        ones yield), a standard one for every critical ticket and ``blocks_ahead_of`` it, a sheddable one for
        the sheddable tickets queued that VTC admits before it (the pace it is judged by has critical work in
        it already), since the oldest of them queued."""
        priority_class = ticket.priority_class
        if priority_class == slo.SHEDDABLE:
            return self._sheddable_before(ticket)
        if priority_class != slo.CRITICAL:
            return slo.Backlog(self.blocks_queued(slo.CRITICAL) + self.blocks_ahead_of(ticket))
        if not self.fair.queued:
            return slo.Backlog(0)
        now = time.monotonic()
        return slo.Backlog(sum(t.blocks for q in self.fair.tenants.values() for lane in q.lanes.values() for t in lane
                               if t.priority_class == slo.CRITICAL and not slo.late(t, now)))

    def _sheddable_before(self, ticket: Ticket) -> slo.Backlog:
        """The sheddable blocks queued that VTC admits before the ticket (``fairness.served_before``: its own
        tenant's, and of every other tenant's what it gets while behind the ticket's tenant's counter), less
        the ticket's own, since the oldest sheddable ticket queued. With several sheddable tenants the same
        backlog is a second's wait for a tenant behind on service and ten for one ahead of it."""
        if not self.fair.queued:
            return slo.Backlog(0)
        own, others, since = self.queue_of(ticket.tenant), [], None
        own_blocks = 0
        for queue in self.fair.tenants.values():
            blocks = 0
            for lane in queue.lanes.values():
                for t in lane:
                    if t.priority_class == slo.SHEDDABLE:
                        blocks += t.blocks
                        since = t.enqueued_at if since is None else min(since, t.enqueued_at)
            if queue is own:
                own_blocks = blocks
            elif blocks:
                others.append((queue, blocks))
        per_block = (ticket.prompt_tokens * INPUT_COST + ticket.max_tokens * OUTPUT_COST) / max(1, ticket.blocks)
        before = served_before(own, own_blocks + ticket.blocks, per_block, others, len(own) > 0)
        return slo.Backlog(max(0, round(before) - ticket.blocks), since)

    async def submit(self, ticket: Ticket) -> None:
        """Queue ``ticket`` and wait for admission. Raises ``GuardError``; on cancellation nothing is held."""
        if self.closed is not None:
            raise self.closed
        if ticket.objective is not None:
            if self.predicting_until != math.inf:
                self.predicting_until = time.monotonic() + slo.PREDICTING_S
            slo.judge(self.pool, self.departures, self.correction, ticket, self.blocks_before(ticket))
        queue = self.queue_of(ticket.tenant)
        if not self.fair.queued:
            budget = self.pool.budget()  # summed once for the cap and the guarantee (both read it)
            if self._within_cap(queue, ticket, budget) and await self._place_now(queue, ticket, budget):
                self._admitted(queue, ticket)  # nobody waits, so VTC order has nothing to say: no queue, no future
                return
        ahead = self.blocks_ahead_of(ticket) + ticket.blocks
        held = self.pool.committed() - self._not_waited_for(ticket)
        wait = self.pool.expected_wait(max(0, held + ahead - self.pool.budget()))
        if wait is not None and wait > ticket.lane.timeout:
            raise GuardError(503, f"the expected queueing time ({wait:.1f} s) exceeds this lane's timeout "
                             f"({ticket.lane.timeout:g} s)", code="overloaded", retry_after=self.pool.retry_after(ahead))
        ticket.enqueued_at = time.monotonic()
        ticket.state = TicketState.QUEUED
        self.fair.push(queue, ticket.order, ticket)
        self.departures.queued()
        self.pump()
        if ticket.state is TicketState.QUEUED and len(queue) > ticket.tenant.max_queue:
            self._dequeue(ticket)  # max_queue counts waiting requests: one admitted at once never waited
            raise GuardError(429, f"tenant {ticket.tenant.name!r} already has {len(queue)} requests queued "
                             f"(max_queue {ticket.tenant.max_queue})", code="queue_full",
                             retry_after=self.pool.retry_after(self.blocks_queued()))
        if ticket.state is TicketState.ADMITTED:
            return  # admitted at once by pump: no future, no deadline
        ticket.admitted = asyncio.get_running_loop().create_future()  # before any await: pump sets it
        limit = slo.queue_limit(ticket, ticket.arrived or ticket.enqueued_at, ticket.enqueued_at)
        try:  # queued, a ticket is served or leaves at its limit
            await asyncio.wait_for(asyncio.shield(ticket.admitted), limit)
        except TimeoutError:
            self._dequeue(ticket)
            if ticket.state is TicketState.ADMITTED:  # admitted in the same instant the deadline passed
                return
            raise self._queue_timeout(ticket, limit) from None
        except asyncio.CancelledError:
            self.finish(ticket)  # the client left: out of the queue, or its fresh reservation back
            raise

    def _not_waited_for(self, ticket: Ticket) -> int:
        """Of the pool's committed blocks, those the ticket's expected wait at arrival does not count as held
        ahead of it: for a critical ticket all that others borrowed (it reclaims it: guard/pool/gate.py); for
        a standard one the sheddable work's (``sheddable_held``: batch lines and sheddable requests, all
        lent); none for a sheddable one. Sheddable blocks drain as their requests end, and little replaces
        them while a standard ticket queues (the batch pacer starts no line while anyone queues,
        guard/batch/pace.py; a sheddable request is lent room only under the threshold, while a standard one
        within its guarantee reclaims lent blocks up to the whole pool), so they are no backlog it waits
        behind at the measured drain rate. Counting them refused interactive requests 503 ``overloaded``
        beside a batch (bench/batch.py, issue 44): right after an idle spell the batch filled the budget while
        the drain rate, measured over the last 10 s, was still a fraction of the lines' pace, so the predicted
        wait passed the lane's timeout though a line ending would make room within a second. Only this
        refusal reads it: whether a ticket fits stays the gates' (or the ledger's) decision, so admission
        keeps its bounds (the budget; the whole pool for reclaimed lent blocks). A sheddable ticket on a
        replica that is down is subtracted though ``committed`` leaves it out: the estimate errs towards
        queueing, where the lane's timeout still bounds the wait."""
        priority_class = ticket.priority_class
        if priority_class == slo.CRITICAL:
            return self.pool.borrowed()
        return self.sheddable_held if priority_class != slo.SHEDDABLE else 0

    def pump(self) -> None:
        """Admit as many queued tickets as the pool and the VTC order allow (with a ledger up, the admission
        task does: a pump cannot wait for Redis)."""
        if not self.fair.queued:
            return  # the usual case after a release
        if self.ledger is not None and (self.ledger.up or self._in_round):
            self._wake.set()
            return
        self._admit_queued()

    def _admission(self) -> Generator[tuple[TenantQueue[Ticket], Ticket, int], Placed, None]:
        """The one admission round, whoever decides the reservations: offers each queue head in turn (the
        priority band, then VTC; a tenant at its cap passed over) with the pool's budget read for it, and is
        sent what became of it. A borrowing head that found no room passes to the next tenant, never holding
        up one within its guarantee; any other stops the round, so big requests are not starved by small ones."""
        passed: set[str] = set()
        while (queue := self._next_tenant(passed)) is not None:
            ticket = queue.head()
            assert ticket is not None
            if ticket.admitted is not None and slo.too_late(self.pool, ticket, time.monotonic()):
                self._drop_late(ticket)  # (None: its submit is placing it at arrival, just judged)
                continue
            budget = self.pool.budget()  # summed once per placement for the cap and the guarantee
            if not self._within_cap(queue, ticket, budget):
                passed.add(queue.name)
                continue
            placed = yield queue, ticket, budget
            if placed == "admitted":
                self.fair.remove(queue, ticket.order, ticket)
                self.departures.add(ticket.blocks, emptied=not self.fair.queued)
                self.correction.observe(ticket.wait_key, ticket.predicted_wait, time.monotonic() - ticket.enqueued_at,
                                        ticket.corrected_wait, slo.decisive(ticket))
                self._admitted(queue, ticket)
            elif placed == "fair" or (placed == "full" and ticket.borrowed):
                passed.add(queue.name)
            elif placed == "full":
                return

    def _drop_late(self, ticket: Ticket) -> None:
        """A queued sheddable ticket whose turn came too late to be on time leaves, as at its deadline."""
        self._dequeue(ticket)
        assert ticket.admitted is not None
        ticket.admitted.set_exception(self._queue_timeout(ticket, 0.0))

    def _queue_timeout(self, ticket: Ticket, limit: float) -> GuardError:
        """Why a queued ticket left unadmitted at ``limit`` (``slo.queue_limit``'s; 0: its turn came too late)."""
        return GuardError(503, f"not admitted within {slo.queue_bound(ticket, limit)}", code="queue_timeout",
                          retry_after=self.pool.retry_after(self.blocks_queued()))

    def _admit_queued(self) -> None:
        """The admission round on the gates of this process."""
        round_ = self._admission()
        step = next(round_, None)
        while step is not None:
            queue, ticket, budget = step
            try:
                step = round_.send("admitted" if self._place(queue, ticket, budget) else "full")
            except StopIteration:
                break

    async def run(self) -> None:
        """With a ledger, the admission task (for the guard's lifetime): admit queued tickets through the
        ledger whenever anything may have changed, and retry a blocked head every ``RETRY_S``."""
        ledger = self.ledger
        assert ledger is not None
        while not ledger.stopping:
            await self._wake.wait()
            self._wake.clear()
            while self.fair.queued and ledger.up and not await self._shared_round():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), RETRY_S)
                self._wake.clear()
            if not ledger.up:
                self._admit_queued()  # the link went down during a round: the gates decide alone from here

    async def _shared_round(self) -> bool:
        """The admission round through the ledger; True when the queue emptied."""
        assert self.ledger is not None
        self._in_round = True
        try:
            round_ = self._admission()
            step = next(round_, None)
            while step is not None:
                queue, ticket, budget = step
                placed = await self._place_shared(queue, ticket, budget)
                if ticket.state is not TicketState.QUEUED:  # it left (or timed out) while the ledger was asked
                    if placed == "admitted":
                        self.ledger.release(ticket)
                    placed = "gone"
                try:
                    step = round_.send(placed)
                except StopIteration:
                    break
            return not self.fair.queued
        finally:
            self._in_round = False

    def _next_tenant(self, skip: set[str]) -> TenantQueue[Ticket] | None:
        """The priority band before fairness: the tenants whose next ticket is critical, by VTC among them,
        go before the rest (by VTC); among them, those whose next critical ticket can still be on time go
        first (``slo.late``: a late one yields; each tenant's late heads are moved behind its on-time ones
        here, as they come to the head)."""
        now = time.monotonic()
        on_time: list[TenantQueue[Ticket]] = []
        late: list[TenantQueue[Ticket]] = []
        for queue in self.fair.backlogged():
            if queue.name in skip:
                continue
            head = queue.head()
            while head is not None and not head.late and slo.late(head, now):
                order = head.order
                head.late = True
                self.fair.move(queue, order, head.order, head)
                head = queue.head()
            if head is not None and head.priority_class == slo.CRITICAL:
                (late if head.late else on_time).append(queue)
        critical = on_time or late
        if not critical:
            return self.fair.next_tenant(skip)
        return min(critical, key=lambda q: q.counter)

    async def _place_now(self, queue: TenantQueue[Ticket], ticket: Ticket, budget: int | None = None) -> bool:
        """``_place`` for a ticket that nobody queues before, through the ledger while it is up; ``budget``
        is the pool's, just read."""
        if self.ledger is None or not self.ledger.up:
            return self._place(queue, ticket, budget)
        return await self._place_shared(queue, ticket, budget) == "admitted"

    def _place(self, queue: TenantQueue[Ticket], ticket: Ticket, budget: int | None = None) -> bool:
        """Reserve the ticket's blocks on the first replica, in the profile's order, whose gate admits them;
        ``ticket.borrowed`` says how many of them are (or would be) borrowed. ``budget``: the pool's, read in
        the same step (None: read it here)."""
        ticket.borrowed = self._lent(ticket, ticket.blocks, budget)
        ranked = self.profile.rank(self.pool.replicas, ranking_request(ticket))
        for candidate in ranked:
            if candidate.replica.gate.try_reserve(ticket.request_id, queue.name, ticket.blocks, ticket.borrowed):
                self._placed(ticket, candidate, ranked)
                return True
        return False

    async def _place_shared(self, queue: TenantQueue[Ticket], ticket: Ticket, budget: int | None = None) -> Placed:
        """``_place`` through the ledger: the same ranking and lending, the ledger deciding room and the VTC
        turn across guards. Redis down: the gates decide alone."""
        assert self.ledger is not None
        ticket.borrowed = self._lent(ticket, ticket.blocks, budget)
        ranked = self.profile.rank(self.pool.replicas, ranking_request(ticket))
        placed = await self.ledger.reserve(queue.name, ticket, ranked,
                                           functools.partial(self._placed, ticket, ranked=ranked))
        if placed == "down":
            return "admitted" if self._place(queue, ticket) else "full"
        return placed

    @staticmethod
    def _placed(ticket: Ticket, candidate: Candidate, ranked: Sequence[Candidate]) -> None:
        """The reservation is on ``candidate``'s replica (its gate holds it): the ticket keeps the ranking
        that admitted it."""
        replica = candidate.replica
        ticket.replica, ticket.hit_blocks, ticket.candidates = replica, candidate.hit_blocks, ranked
        replica.admitted()

    def guarantee(self, tenant: Tenant, budget: int | None = None) -> int:
        """Blocks the tenant is guaranteed: its weighted share of the pool's budget (0 once a reload removed
        it: whatever it still runs is borrowed). ``budget``: the pool's, if the caller has just read it."""
        if tenant.name in self.retired or not self.total_weight:
            return 0
        return int(tenant.weight / self.total_weight * (self.pool.budget() if budget is None else budget))

    def _lent(self, ticket: Ticket, blocks: int, budget: int | None = None) -> int:
        """Of ``blocks`` more for the ticket, those it borrows: none for a critical one (it reclaims what
        others borrowed), all for a sheddable one (lent, so critical work reclaims it and the engine preempts
        it first), past its tenant's guarantee for the rest."""
        priority_class = ticket.priority_class
        if priority_class == slo.CRITICAL:
            return 0
        return blocks if priority_class == slo.SHEDDABLE else self._borrowed(ticket.tenant, blocks, budget)

    def _borrowed(self, tenant: Tenant, blocks: int, budget: int | None = None) -> int:
        """Of ``blocks`` more for the tenant, those past its guarantee."""
        room = max(0, self.guarantee(tenant, budget) - self.pool.tenant_guaranteed(tenant.name))
        return max(0, blocks - room)

    def _within_cap(self, queue: TenantQueue[Ticket], ticket: Ticket, budget: int | None = None) -> bool:
        """The tenant's reservations may grow by this ticket (one request alone is always within its cap)."""
        held = self.pool.tenant_reserved(queue.name)
        if budget is None:
            budget = self.pool.budget()
        cap = int(self.block_caps.get(queue.name, ticket.tenant.max_blocks_share) * budget)
        return not held or held + ticket.blocks <= cap

    def _admitted(self, queue: TenantQueue[Ticket], ticket: Ticket) -> None:
        """The ticket's reservation is committed: charge its input and wake its request."""
        self.fair.charge(queue, input_tokens=ticket.prompt_tokens)
        if ticket.enqueued_at and ticket.priority_class == slo.SHEDDABLE:  # (0: admitted without queueing)
            self.departures.sheddable.left(ticket.enqueued_at, ticket.blocks)
        ticket.state = TicketState.ADMITTED
        # The prefill now ahead of later requests there (guard/pool/latency.py), while predictions are read.
        if ticket.replica is not None and ((now := time.monotonic()) < self.predicting_until
                                           or ticket.objective is not None):
            ticket.admitted_at = now
            snapshot = ticket.replica.gate.snapshot
            cached = ticket.hit_blocks * snapshot.block_size if snapshot is not None else 0
            ticket.uncached = max(0, ticket.prompt_tokens - cached)
            ticket.priority = engine_priority(ticket.lane.priority, ticket.borrowed)
            latency, judged = ticket.replica.latency, ticket.objective is not None
            # Predicted (and learned from) when its prediction is read, or when the model samples it.
            ticket.work, ticket.sent = latency.admitted(  # in_flight has it since its reservation
                ticket.priority, ticket.uncached, ticket.prompt_tokens, ticket.replica.in_flight - 1,
                ticket.stream or judged, judged or latency.sample(ticket.admitted_at))
            ticket.prefilling = True
            if judged:
                slo.placed(ticket)
        self.running.setdefault(queue.name, set()).add(ticket)
        if ticket.priority_class == slo.SHEDDABLE:
            self.sheddable_held += ticket.blocks
        if ticket.admitted is not None:  # None while submit is admitting it itself
            ticket.admitted.set_result(None)

    def grow(self, ticket: Ticket, blocks: int, max_tokens: int) -> bool:
        """Grow an admitted ticket's reservation to ``blocks`` (its output bound to ``max_tokens``) on its
        replica, if that replica has room; False leaves the ticket as it was."""
        if ticket.state is not TicketState.ADMITTED or ticket.replica is None:
            return False
        if self.ledger is not None and self.ledger.up:
            return False  # growing would cost a round trip on every token past the prediction (ledger.py)
        more = blocks - ticket.blocks
        borrowed = self._lent(ticket, more)
        if not ticket.replica.gate.try_grow(ticket.request_id, more, borrowed):
            return False
        if ticket.priority_class == slo.SHEDDABLE:
            self.sheddable_held += more
        ticket.blocks, ticket.max_tokens = blocks, max_tokens
        ticket.borrowed += borrowed
        return True

    def started(self, ticket: Ticket, after_s: float | None = None) -> None:
        """The ticket's first token came ``after_s`` seconds after its admission (None: it ended without
        one): its prefill leaves the work ahead there, and its replica's latency model learns it if it was
        predicted (guard/pool/latency.py, "What is learned from"). Once."""
        if ticket.replica is None or not ticket.prefilling:
            return
        latency = ticket.replica.latency
        latency.started(ticket.priority, ticket.uncached, ticket.prompt_tokens)
        if after_s is not None and ticket.sent is not None:
            latency.observe_ttft(ticket.priority, ticket.work, after_s, ticket.sent)
        ticket.uncached = ticket.work = 0
        ticket.prefilling = False

    def charge_output(self, ticket: Ticket, output_tokens: int) -> None:
        ticket.output_tokens = output_tokens
        self.fair.charge(self.queue_of(ticket.tenant), output_tokens=output_tokens)

    def finish(self, ticket: Ticket) -> None:
        """End ``ticket`` in whatever state it is: dequeue or release its reservation. Idempotent."""
        if ticket.state is TicketState.QUEUED:
            self._dequeue(ticket)
        elif ticket.state is TicketState.ADMITTED:
            assert ticket.replica is not None  # set with the reservation
            if self.ledger is not None:
                self.ledger.release(ticket)
            self.started(ticket)  # ended without a first token: its prefill is ahead of nobody now
            ticket.replica.gate.release(ticket.request_id)
            ticket.replica.finished()
            running = self.running[ticket.tenant.name]
            running.discard(ticket)
            if not running:
                del self.running[ticket.tenant.name]
            if ticket.priority_class == slo.SHEDDABLE:
                self.sheddable_held -= ticket.blocks
            self.pump()
        ticket.state = TicketState.DONE
        if self.retired:
            self._drop_idle_retired()

    def _drop_idle_retired(self) -> None:
        idle = {name for name in self.retired
                if not len(self.fair.tenants[name]) and not self.pool.tenant_reserved(name)}
        for name in idle:
            self.fair.drop(name)
            self.block_caps.pop(name, None)
        self.retired -= idle
        self._count_as_ours()

    def _count_as_ours(self) -> None:
        ours = set(self.fair.tenants)
        for replica in self.pool:
            replica.gate.guard_tenants = ours

    def stop(self) -> None:
        """End the admission task (shutdown; the ledger's link is stopped first)."""
        self._wake.set()

    def reject_all(self, reason: GuardError) -> None:
        """Fail every queued ticket with ``reason``, and every later one (shutdown); admitted ones run on."""
        self.closed = reason
        for name in self.fair.tenants:
            self.reject_queued(name, reason)

    def reject_queued(self, tenant: str, reason: GuardError) -> int:
        """Fail the tenant's queued tickets with ``reason`` (admitted ones run on); returns how many."""
        queue = self.fair.tenants[tenant]
        rejected = 0
        while len(queue):
            ticket = self.fair.pop(queue)
            self._left(ticket)  # as a deadline's do
            assert ticket.admitted is not None  # a queued ticket's submit created it before waiting
            ticket.admitted.set_exception(reason)
            rejected += 1
        return rejected

    def revoke(self, tenant: str, reason: GuardError) -> int:
        """End the tenant's admitted requests with ``reason`` (each releases its reservation as it ends);
        returns how many were told."""
        tickets = list(self.running.get(tenant, ()))
        for ticket in tickets:
            ticket.revoked = reason
            if ticket.on_revoke is not None:
                ticket.on_revoke(reason)
        return len(tickets)

    def _dequeue(self, ticket: Ticket) -> None:
        if ticket.state is TicketState.QUEUED and self.fair.remove(self.queue_of(ticket.tenant),
                                                                    ticket.order, ticket):
            self._left(ticket)

    def _left(self, ticket: Ticket) -> None:
        """``ticket``, just taken off the queue, left it unadmitted (a deadline, its client, a rejection): it
        is done, and its blocks count in the queue's pace (a sheddable one's as its backlog's too)."""
        ticket.state = TicketState.DONE
        self.departures.add(ticket.blocks, emptied=not self.fair.queued)
        if ticket.priority_class == slo.SHEDDABLE:
            self.departures.sheddable.left(ticket.enqueued_at, 0)
