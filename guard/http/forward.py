"""Forwarding: an admitted request sent to its replica and the answer relayed, with failover.

``to_pool`` sends an admitted request to the replica its ticket holds a reservation on. A replica that
cannot be reached before a single byte was sent to it (refused or unaccepted connection) has its circuit
opened at once, and the request is admitted again on the replicas left; when none is left,
``UpstreamUnavailable`` goes up to the pipeline, which makes one attempt on the first usable fallback.
A replica that lets a resumable request down after it was sent (it died, went silent or drains) has the
request moved to another replica, where its answer continues (guard/http/migrate.py).
``forward`` is one attempt on one backend, for the pool and the fallbacks alike.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from aiohttp import web

from guard.admission.ticket import TicketState
from guard.errors import Outcome
from guard.http import migrate
from guard.http.exchange import Exchange, stamp_headers
from guard.pool.gate import BORROWED_PRIORITY
from guard.pool.replica import Replica
from guard.wire.errors import error_response
from guard.wire.relay import StreamObserver, UpstreamUnavailable
from guard.wire.resume_tap import ResumeTap
from guard.wire.upstream import Answer, UpstreamError

log = logging.getLogger("guard.forward")


async def to_pool(ex: Exchange) -> web.StreamResponse:
    """The admitted request on its replica; on a replica that is not there, admitted again elsewhere; on one
    that lets it down once sent, moved (guard/http/migrate.py)."""
    state, parsed, sizing, entry = ex.state, ex.parsed, ex.sizing, ex.entry
    metrics = state.metrics
    # A client's own bound, or a suspect's cap, goes upstream; otherwise none, and the engine bounds the
    # output by its window and its own pool (which may hold fewer tokens than the window).
    max_tokens = sizing.bound if sizing.declared or sizing.capped else None
    tap = entry.observer.tap = migrate.tap_for(parsed)
    while True:
        ticket = entry.ticket
        replica = ticket.replica
        if replica is None:  # admitted tickets have one: a bug, not the client's
            raise RuntimeError(f"ticket {ticket.request_id} admitted without a replica")
        if ex.revoked is not None:
            raise ex.revoked
        # A ticket that borrows runs at a lower engine priority, so the engine preempts borrowers first.
        body = parsed.upstream_body(cache_salt=entry.salt, max_tokens=max_tokens,
                                    priority=sizing.lane.priority + (BORROWED_PRIORITY if ticket.borrowed else 0))
        metrics.child(metrics.routed, replica.name).inc()
        metrics.child(metrics.prefix_predicted, replica.name).inc(ticket.hit_blocks * sizing.block_size)
        if tap.choices > 1 and tap.response is not None:  # moved: each choice on its own
            return await _resume_choices(ex, replica, migrate.choice_bodies(body, parsed, tap))
        if parsed.stream:  # a unary answer's client has seen nothing: it is sent again as it was
            body = migrate.resume_body(body, parsed, tap)
        try:
            response, ex.outcome = await forward(ex, replica.url, replica.name, body, entry.observer, route=None)
        except UpstreamUnavailable as exc:
            if tap.response is None:  # nothing sent yet: the pipeline may try a fallback
                await _fail_over(ex)
                continue
            try:  # a moved stream cannot start over on a fallback: it ends if no replica is left
                await _fail_over(ex)
            except UpstreamUnavailable:
                return await _give_up(ex, tap.response, tap, str(exc))
            continue
        if tap.interrupted is None or entry.observer.client_gone:
            return response
        if (why := await migrate.move(ex, tap)) is not None:
            return await _give_up(ex, response, tap, why)


async def _resume_choices(ex: Exchange, replica: Replica, bodies: list[tuple[int, bytes]]) -> web.StreamResponse:
    """A moved stream of several choices: each that had not ended continues as a stream of its own on
    ``replica``, merged into the client's stream (guard/http/migrate.py). Any of them failing ends it with
    its error event."""
    observer, relay = ex.entry.observer, ex.clients.relay
    tap = observer.tap
    assert tap is not None and tap.response is not None
    ex.backend = replica.name
    ex.replicas.append(replica.name)
    parts: list[tuple[int, Answer, ResumeTap]] = []
    try:
        for index, body in bodies:
            opened = await _open(ex, replica.url, replica.name, body, own := ResumeTap())
            if isinstance(opened, tuple):  # the engine failed on the way
                raise UpstreamUnavailable(f"choice {index} was not resumed ({opened[0].status})")
            parts.append((index, opened, own))
    except UpstreamUnavailable as exc:
        for _, upstream, _ in parts:
            relay.abandon(upstream)
        ex.outcome = Outcome.UPSTREAM_ERROR
        await relay.end_stream(tap.response, observer, f"the request's replica failed and {exc}")
        return tap.response
    usages = await relay.merge(ex.request, parts, observer)
    if usages is not None:
        await relay.end_merged(ex.request, observer, migrate.merged_usage(ex, usages))
    ex.outcome = (Outcome.CANCELLED if observer.client_gone
                  else Outcome.UPSTREAM_ERROR if usages is None else Outcome.COMPLETED)
    return tap.response


async def _fail_over(ex: Exchange) -> None:
    """The ticket's replica is not there (nothing was sent to it): admitted again on the replicas left, or
    ``UpstreamUnavailable`` when none is."""
    state, entry = ex.state, ex.entry
    ticket = entry.ticket
    assert ticket.replica is not None
    ticket.replica.breaker.trip()  # nothing listens there: no request should try it again until healthy
    state.dispatcher.finish(ticket)
    if not state.pool.any_usable():
        raise UpstreamUnavailable(f"replica {ticket.replica.name} is not there, and no other is usable")
    entry.ticket = dataclasses.replace(ticket, state=TicketState.NEW, admitted=None, replica=None)
    if entry.growth is not None:
        entry.growth.ticket = entry.ticket
    await state.dispatcher.submit(entry.ticket)


async def _give_up(ex: Exchange, response: web.StreamResponse, tap: ResumeTap, why: str) -> web.StreamResponse:
    """A request that may not move again: its client is told so (its stream's error event, or a 502; one never
    moved, whose client has seen nothing, gets its replica's failure as it came)."""
    log.warning("request %s ends without moving on: %s", ex.request_id, why)
    ex.outcome = Outcome.UPSTREAM_ERROR
    if tap.response is not None:
        await ex.clients.relay.end_stream(tap.response, ex.entry.observer, why)
        return tap.response
    if tap.moves == 0 and tap.moves < ex.state.config.migration.max_migrations:  # no other replica to move to
        return response
    return error_response(502, why, code="upstream_error", headers=stamp_headers(ex.request))


async def forward(
    ex: Exchange, url: str, backend: str, body: bytes, observer: StreamObserver, route: str | None,
) -> tuple[web.StreamResponse, Outcome]:
    """Send to an engine and relay its answer. Raises ``UpstreamUnavailable`` if nothing could be sent."""
    ex.backend = backend
    ex.replicas.append(backend)
    opened = await _open(ex, url, backend, body, observer.tap)
    if isinstance(opened, tuple):
        return opened
    upstream = ex.upstream = opened
    if ex.revoked is not None:  # revoked while its headers were on their way
        ex.clients.relay.revoke(upstream, ex.revoked)
    out_headers = stamp_headers(ex.request, route)
    out_headers["X-Guard-Backend"] = backend
    if (charged := getattr(ex, "charge", None)) is not None:  # a limited tenant paces itself by these, on every answer
        out_headers.update(charged.headers())
    if not ex.parsed.stream:
        return await _relay_unary(ex, upstream, out_headers, observer)
    if observer.tap is not None and observer.tap.response is not None:  # moved: its stream goes on
        return await _carry_on(ex, upstream, observer)
    return await _relay_stream(ex, upstream, out_headers, observer)


def _breaker(ex: Exchange, backend: str):
    pool = ex.state.pool
    return pool.by_name[backend].breaker if backend in pool.by_name else ex.state.fallback_breakers[backend]


async def _open(ex: Exchange, url: str, backend: str, body: bytes, tap: ResumeTap | None
                ) -> Answer | tuple[web.StreamResponse, Outcome]:
    """The upstream answer's headers, or the client's 502/504 when the engine failed on the way."""
    state, relay, parsed, tenant = ex.state, ex.clients.relay, ex.parsed, ex.caller.tenant
    metrics, breaker = state.metrics, _breaker(ex, backend)
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity", "X-Tenant-Id": tenant.name,
               "X-Request-Id": ex.request_id}
    if (trace := ex.trace) is not None:
        trace.upstream = trace.upstream or time.monotonic()  # a retry on another replica extends the span
        trace.backend = backend
        headers.update(trace.upstream_headers())
    try:
        upstream = await relay.open(url.rstrip("/") + parsed.path, body, headers, parsed.stream, backend, tap)
    except UpstreamUnavailable:
        metrics.child(metrics.upstream_requests, backend, "error").inc()
        if trace is not None:
            trace.unavailable += ((time.monotonic(), backend),)
        raise
    except (TimeoutError, UpstreamError) as exc:
        metrics.child(metrics.upstream_requests, backend, "error").inc()
        breaker.record_failure()
        if isinstance(exc, TimeoutError):  # as relay.stream says it when the headers came but no token
            message = ("the engine sent no token within the first-token timeout" if parsed.stream
                       else "the engine did not answer within the unary timeout")
            return relay.failure(504, message, "upstream_timeout"), Outcome.UPSTREAM_ERROR
        return relay.failure(502, f"the engine failed: {type(exc).__name__}", "upstream_error"), \
            Outcome.UPSTREAM_ERROR
    metrics.child(metrics.upstream_requests, backend, str(upstream.status)).inc()
    if trace is not None:
        trace.headers, trace.upstream_status = time.monotonic(), upstream.status
    if upstream.status >= 500:
        breaker.record_failure()
    else:
        breaker.record_success()
    return upstream


async def _relay_unary(ex: Exchange, upstream: Answer, headers: dict[str, str],
                       observer: StreamObserver) -> tuple[web.StreamResponse, Outcome]:
    response, answer = await ex.clients.relay.unary(upstream, headers, observer.tap)
    if ex.trace is not None:
        ex.trace.upstream_end = time.monotonic()
    usage = (answer or {}).get("usage")
    usage = usage if isinstance(usage, dict) else {}
    observer.completion_tokens = 0  # an answer without usage generated nothing the guard can charge
    observer.read_usage(usage)
    if ex.revoked is not None and response.status != 200:
        return response, ex.revoked.outcome
    return response, Outcome.COMPLETED if response.status == 200 else Outcome.UPSTREAM_ERROR


async def _carry_on(ex: Exchange, upstream: Answer, observer: StreamObserver) -> tuple[web.StreamResponse, Outcome]:
    """A moved request's stream, continued with its new replica's answer."""
    assert observer.tap is not None and observer.tap.response is not None
    completed = await ex.clients.relay.carry_on(ex.request, upstream, observer)
    if (trace := ex.trace) is not None:
        trace.upstream_end, trace.token_events = time.monotonic(), observer.events
    if observer.client_gone:
        return observer.tap.response, Outcome.CANCELLED
    return observer.tap.response, Outcome.COMPLETED if completed else Outcome.UPSTREAM_ERROR


async def _relay_stream(ex: Exchange, upstream: Answer, headers: dict[str, str],
                        observer: StreamObserver) -> tuple[web.StreamResponse, Outcome]:
    response = await ex.clients.relay.stream(ex.request, upstream, headers, observer)
    if (trace := ex.trace) is not None:
        trace.upstream_end, trace.first_token = time.monotonic(), observer.first_at
        trace.token_events = observer.events
    if observer.client_gone:
        return response, Outcome.CANCELLED
    if ex.revoked is not None and (observer.failed or response.status != 200):
        return response, ex.revoked.outcome
    ok = response.status == 200 and not observer.failed
    return response, Outcome.COMPLETED if ok else Outcome.UPSTREAM_ERROR
