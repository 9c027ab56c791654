"""The pool's admission stages, as guard/http/pipeline.py declares them (``POOL``):

    count -> size -> ticket -> limits -> queue -> (forward, guard/http/forward.py)

Each takes the request's ``Exchange``, reads what the stages before it made, and returns its own result
(the runner, guard/http/stages.py, keeps it on the exchange). The policy is admission's: how a reservation
is sized (guard/admission/sizing.py ``size_request``), the ticket (guard/admission/ticket.py), the limits
(guard/admission/limits.py), the fair queue and SLO shedding (guard/admission/dispatch.py, slo.py), the
detector's verdicts (guard/detect/escalation.py); here the request is read into their terms.

What is taken is given back by the runner, in reverse order, however the request ends: the limits' charge
(``settle_charge``: settled to what the request used, or refunded when it never reached an engine), then
the ticket (``finish_ticket``: its reservation released, its output charged to its tenant's fairness
counter and taught to the output predictor).
"""

from __future__ import annotations

import sys
import time

from guard.admission.limits import Charge
from guard.admission.sizing import Growth, Sizing, size_request
from guard.admission.ticket import Ticket, TicketState
from guard.errors import GuardError, Outcome
from guard.http import objectives, responses
from guard.http.exchange import Entry, Exchange
from guard.http.models import adapter_of
from guard.http.tokens import TokenLimits
from guard.pool.prefix_index import prompt_block_hashes
from guard.wire.relay import StreamObserver, UpstreamUnavailable


def refuse_if_confirmed(ex: Exchange) -> None:
    """A confirmed attacker's request is refused before its prompt costs a tokenization."""
    state, tenant = ex.state, ex.caller.tenant
    if state.escalation.confirmed(tenant.name):
        declared = ex.parsed.max_tokens
        state.escalation.refuse(tenant, declared if declared is not None else
                                state.predictor.predict(tenant.name, tenant.lane, sys.maxsize))


async def count(ex: Exchange) -> TokenLimits:
    """The request's prompt tokens and the output its context window leaves, a continued conversation's
    included (an engine that cannot be asked is an unavailable pool, not the client's error); a confirmed
    attacker is refused first. A guard that just started first waits to hear from its engines."""
    await ex.state.pool.wait_while_starting()
    if ex.trace is not None:
        ex.trace.admission = time.monotonic()
    refuse_if_confirmed(ex)
    try:
        if responses.continues(ex.parsed):
            await responses.load_conversation(ex.state, ex.clients, ex.parsed, ex.caller.tenant.name)
        return await ex.clients.counter.count(ex.parsed)
    except GuardError as exc:
        if exc.code == "engine_unavailable":
            raise UpstreamUnavailable(exc.message) from None
        raise


def size(ex: Exchange) -> Sizing:
    """The reservation, as admission sizes it (guard/admission/sizing.py ``size_request``)."""
    state, (tenant, lane), limits = ex.state, ex.caller, ex.limits
    block_size = state.pool.block_size()
    if block_size is None:
        raise UpstreamUnavailable("no telemetry from any engine replica yet")
    return size_request(tenant, lane, limits.prompts, ex.parsed.n, limits.max_tokens, ex.parsed.max_tokens,
                        block_size, state.pool.largest_budget(), state.predictor, state.escalation.shape)


def make_ticket(ex: Exchange) -> Entry:
    """The request's ticket, with its prompts' block hashes when the scheduling profile reads prefix hits
    (a pool of one has nowhere else to route), and the observer its answer will be relayed through."""
    state, tenant, limits, sizing, parsed = ex.state, ex.caller.tenant, ex.limits, ex.sizing, ex.parsed
    salt = state.keys.cache_salt(tenant)
    lora = adapter_of(parsed.model.model, state.pool)
    hashes = ([prompt_block_hashes(ids, sizing.block_size, salt, lora) for ids in limits.ids]
              if state.profile.needs_hashes and len(state.pool) > 1 and limits.ids is not None else [])
    priority_class, named, objective = objectives.resolve(ex, sizing.lane)
    ticket = Ticket(ex.request_id, tenant, sizing.lane, limits.prompt_tokens, sizing.reserve, sizing.blocks, hashes,
                    on_revoke=ex.revoke, arrived=ex.arrived, objective=objective, lora=lora,
                    model=parsed.model.model, priority_class=priority_class, objective_name=named,
                    stream=parsed.stream)
    growth = Growth(sizing, state.dispatcher, ticket) if not sizing.declared else None
    return Entry(ticket, observe(ex, ticket, growth), growth, salt)


def observe(ex: Exchange, ticket: Ticket, growth: Growth | None) -> StreamObserver:
    """The observer the answer is relayed through: first-token and inter-token latencies, and, for a
    request without a bound of its own, its reservation's growth."""
    metrics, tenant = ex.state.metrics, ticket.tenant
    ttft, itl = metrics.child(metrics.ttft, tenant.name), metrics.child(metrics.itl, tenant.name)
    on_gap = itl.observe
    if growth is not None:
        def on_gap(gap: float) -> None:
            itl.observe(gap)
            if (granted := growth.on_tokens(observer.events)) is not None:
                metrics.child(metrics.reservation_growths, "granted" if granted else "denied").inc()

    arrived, dispatcher = ex.arrived, ex.state.dispatcher

    def on_first_token(now: float) -> None:
        ttft.observe(now - arrived)
        dispatcher.started(ticket, now - ticket.admitted_at)  # the replica's latency model learns it

    parsed = ex.parsed
    observer = responses.observer_class(parsed)(on_first_token=on_first_token, on_gap=on_gap,
                                                strip_usage=parsed.adds_usage)
    return observer


async def charge(ex: Exchange) -> Charge | None:
    """Limits come before the fair queue and the KV budget: charged what the reservation covers, now."""
    sizing = ex.sizing
    return await ex.state.limiter.charge(ex.caller.tenant, ex.limits.prompt_tokens + sizing.reserve * sizing.sequences)


async def queue(ex: Exchange) -> None:
    """Wait in the fair queue until a replica's gate commits the reservation."""
    ticket, trace = ex.entry.ticket, ex.trace
    if trace is not None:
        trace.queued, trace.blocks = time.monotonic(), ticket.blocks
    await ex.state.dispatcher.submit(ticket)
    admitted = time.monotonic()
    ex.state.metrics.child(ex.state.metrics.queue_wait, ticket.tenant.name).observe(admitted - ex.arrived)
    if trace is not None:
        trace.admitted, trace.waited = admitted, ticket.enqueued_at > 0.0


def settle_charge(ex: Exchange) -> None:
    """The limits' release: a ticket still admitted reached an engine and is charged what it used; any
    other gives its charge back."""
    if (charged := ex.charge) is not None:
        entry = ex.entry
        charged.settle(ex.limits.prompt_tokens + entry.observer.output_tokens
                       if entry.ticket.state is TicketState.ADMITTED else None)


def finish_ticket(ex: Exchange) -> None:
    """The ticket's release: its reservation goes back, once, its output is charged to its tenant's
    fairness counter and taught to the output predictor."""
    state, entry, sizing = ex.state, ex.entry, ex.sizing
    ticket, observer = entry.ticket, entry.observer
    if ticket.state is TicketState.NEW:
        return  # refused before it queued (by its rate limits): it holds nothing, and served nothing
    if ex.outcome is Outcome.CANCELLED and observer.finished:
        ex.outcome = Outcome.COMPLETED  # the client hung up after [DONE]: it got everything
    if ex.outcome is Outcome.COMPLETED and not sizing.declared:
        tenant = ticket.tenant
        state.predictor.record(tenant.name, tenant.lane, -(-observer.output_tokens // sizing.sequences))
    state.dispatcher.charge_output(ticket, observer.output_tokens)
    state.dispatcher.finish(ticket)
