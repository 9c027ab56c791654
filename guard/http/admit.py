"""The pool's admission stages, in the order guard/http/pipeline.py ``serve_pool`` runs them:

    count -> size -> charge -> queue -> (forward, guard/http/forward.py) -> settle

Each takes the ``Exchange`` and fills in its part. ``count`` and ``size`` only compute; ``charge`` takes
the tenant's rate limits, ``queue`` a reservation: from there on, ``settle`` (in a ``finally``) gives back
whatever is held, exactly once, however the request ends.
"""

from __future__ import annotations

import sys
import time

from guard.admission.sizing import Growth, size_reservation
from guard.admission.ticket import Ticket, TicketState
from guard.errors import GuardError, Outcome
from guard.http import objectives, responses
from guard.http.exchange import Exchange
from guard.http.models import adapter_of
from guard.http.tokens import TokenLimits
from guard.pool.prefix_index import prompt_block_hashes
from guard.wire.relay import StreamObserver, UpstreamUnavailable


def refuse_if_confirmed(ex: Exchange) -> None:
    """A confirmed attacker's request is refused before its prompt costs a tokenization."""
    state, tenant, parsed = ex.state, ex.tenant, ex.parsed
    assert tenant is not None and parsed is not None
    if state.escalation.confirmed(tenant.name):
        declared = parsed.max_tokens
        state.escalation.refuse(tenant, declared if declared is not None else
                                state.predictor.predict(tenant.name, tenant.lane, sys.maxsize))


async def count(ex: Exchange) -> TokenLimits:
    """The request's prompt tokens and the output its context window leaves, a continued conversation's
    included (an engine that cannot be asked is an unavailable pool, not the client's error)."""
    assert ex.parsed is not None and ex.tenant is not None
    try:
        if responses.continues(ex.parsed):
            await responses.load_conversation(ex.state, ex.clients, ex.parsed, ex.tenant.name)
        ex.limits = await ex.clients.counter.count(ex.parsed)
    except GuardError as exc:
        if exc.code == "engine_unavailable":
            raise UpstreamUnavailable(exc.message) from None
        raise
    return ex.limits


def size(ex: Exchange) -> None:
    """The reservation: the client's bound, or the predicted output of its tenant's lane, shaped by the
    detector's verdict on the tenant (a suspect's output is capped and its lane demoted)."""
    state, tenant, parsed, limits = ex.state, ex.tenant, ex.parsed, ex.limits
    assert tenant is not None and ex.lane is not None and parsed is not None and limits is not None
    pool = state.pool
    block_size = pool.block_size()
    if block_size is None:
        raise UpstreamUnavailable("no telemetry from any engine replica yet")
    declared = parsed.max_tokens is not None
    bound = limits.max_tokens  # what each sequence may generate: the client's bound, or the context's room
    # Without a bound of its own a request reserves what such requests generate, not the whole room.
    reserve = bound if declared else state.predictor.predict(tenant.name, tenant.lane, bound)
    cap, ex.lane = state.escalation.shape(tenant, ex.lane, reserve)
    if cap is not None:
        bound, reserve, ex.capped = min(bound, cap), min(reserve, cap), True
    ex.sizing = size_reservation(block_size, limits.prompts, parsed.n, bound, reserve, declared,
                                 pool.largest_budget())


def make_ticket(ex: Exchange) -> Ticket:
    """The request's ticket, with its prompts' block hashes when the scheduling profile reads prefix hits
    (a pool of one has nowhere else to route)."""
    state, tenant, limits, sizing = ex.state, ex.tenant, ex.limits, ex.sizing
    assert tenant is not None and ex.lane is not None and limits is not None and sizing is not None
    ex.salt = salt = state.keys.cache_salt(tenant)
    assert ex.parsed is not None
    lora = adapter_of(ex.parsed.model.model, state.pool)
    hashes = ([prompt_block_hashes(ids, sizing.block_size, salt, lora) for ids in limits.ids]
              if state.profile.needs_hashes and len(state.pool) > 1 and limits.ids is not None else [])
    ex.ticket = Ticket(ex.request_id, tenant, ex.lane, limits.prompt_tokens, sizing.reserve, sizing.blocks,
                       hashes, on_revoke=ex.revoke, arrived=ex.arrived, objective=objectives.resolve(ex), lora=lora,
                       model=ex.parsed.model.model)
    return ex.ticket


def observe(ex: Exchange) -> StreamObserver:
    """The observer the answer is relayed through: first-token and inter-token latencies, and, for a
    request without a bound of its own, its reservation's growth."""
    state, tenant, parsed, sizing, ticket = ex.state, ex.tenant, ex.parsed, ex.sizing, ex.ticket
    assert tenant is not None and parsed is not None and sizing is not None and ticket is not None
    metrics = state.metrics
    ttft, itl = metrics.child(metrics.ttft, tenant.name), metrics.child(metrics.itl, tenant.name)
    on_gap = itl.observe
    if not sizing.declared:
        growth = ex.growth = Growth(sizing, state.dispatcher, ticket)

        def on_gap(gap: float) -> None:
            itl.observe(gap)
            if (granted := growth.on_tokens(observer.events)) is not None:
                metrics.child(metrics.reservation_growths, "granted" if granted else "denied").inc()

    arrived, dispatcher = ex.arrived, state.dispatcher

    def on_first_token(now: float) -> None:
        ttft.observe(now - arrived)
        dispatcher.started(ticket, now - ticket.admitted_at)  # the replica's latency model learns it

    observer = ex.observer = responses.observer_class(parsed)(on_first_token=on_first_token, on_gap=on_gap,
                                                              strip_usage=parsed.adds_usage)
    return observer


async def charge(ex: Exchange) -> None:
    """Limits come before the fair queue and the KV budget: charged what the reservation covers, now."""
    assert ex.tenant is not None and ex.limits is not None and ex.sizing is not None
    sizing = ex.sizing
    ex.charge = await ex.state.limiter.charge(ex.tenant, ex.limits.prompt_tokens + sizing.reserve * sizing.sequences)


async def queue(ex: Exchange) -> None:
    """Wait in the fair queue until a replica's gate commits the reservation."""
    ticket, trace = ex.ticket, ex.trace
    assert ticket is not None
    if trace is not None:
        trace.queued, trace.blocks = time.monotonic(), ticket.blocks
    await ex.state.dispatcher.submit(ticket)
    admitted = time.monotonic()
    ex.state.metrics.child(ex.state.metrics.queue_wait, ticket.tenant.name).observe(admitted - ex.arrived)
    if trace is not None:
        trace.admitted, trace.waited = admitted, ticket.enqueued_at > 0.0


def settle(ex: Exchange) -> None:
    """Whatever the request holds goes back, once: its reservation, its rate-limit charge (settled to what
    it used, or refunded when it never reached an engine), and its output is charged to its tenant's
    fairness counter and taught to the output predictor."""
    state, tenant, limits, sizing, ticket, observer = ex.state, ex.tenant, ex.limits, ex.sizing, ex.ticket, \
        ex.observer
    assert tenant is not None and limits is not None and sizing is not None and ticket is not None
    assert observer is not None
    if ex.outcome is Outcome.CANCELLED and observer.finished:
        ex.outcome = Outcome.COMPLETED  # the client hung up after [DONE]: it got everything
    if ex.outcome is Outcome.COMPLETED and not sizing.declared:
        state.predictor.record(tenant.name, tenant.lane, -(-observer.output_tokens // sizing.sequences))
    if ex.charge is not None:  # a ticket still admitted reached an engine; any other gives its charge back
        ex.charge.settle(limits.prompt_tokens + observer.output_tokens if ticket.state is TicketState.ADMITTED
                         else None)
    state.dispatcher.charge_output(ticket, observer.output_tokens)
    state.dispatcher.finish(ticket)
