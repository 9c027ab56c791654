"""The completion pipeline: one request from the client's bytes to its final answer, as named stages.

    authenticate -> parse -> route by mode -> (the pool) refuse a confirmed attacker -> count -> size ->
    ticket -> charge limits -> queue -> forward with failover (guard/http/forward.py) -> settle

The admission stages are guard/http/admit.py; each takes the request's ``Exchange`` (guard/http/exchange.py)
and fills in its part. A stage that refuses raises ``GuardError``; ``completion`` turns it into the response,
and records the request's one ``guard_requests_total`` outcome in its ``finally``: every request that
reaches the guard is counted once, however it ends. Once charged and queued, ``settle`` runs in a
``finally`` too: completion, upstream failure and a client that leaves all give the blocks back, and the
rate-limit charge is settled, once, to what the request used (guard/admission/limits.py). When no replica
could be sent the request, it makes one attempt on the first usable fallback.

Tracing (guard/tracing.py): with ``tracing.ENABLED``, the ``Exchange`` carries a ``GuardTrace`` and the
stages store their timestamps in it; without, ``ex.trace`` is None and each stage's only cost is that test.
"""

from __future__ import annotations

import time

from aiohttp import web

from guard import tracing
from guard.config import Tenant
from guard.errors import GuardError, Outcome
from guard.http import admit, objectives, responses
from guard.http.ambiguity import refuse_ambiguous
from guard.http.clients import CLIENTS
from guard.http.decision import keep_record
from guard.http.exchange import Exchange, stamp_headers
from guard.http.forward import forward, to_pool
from guard.http.models import check_model
from guard.http.static import static_response
from guard.http.validate import parse_request
from guard.instance import STATE
from guard.pool.routing import Route
from guard.wire.errors import error_response
from guard.wire.relay import UpstreamUnavailable
from guard.wire.stamp import REQUEST_ID, TENANT

# A request the guard makes itself (a batch line, guard/batch/line.py) carries its tenant and lane here, in
# place of an API key.
INTERNAL = web.RequestKey("internal", tuple)


def authenticate(request: web.Request) -> Tenant:
    """The request's tenant, from its one ``Authorization`` header (a request with two of it, or of another
    header that must come once, is refused first: guard/http/ambiguity.py)."""
    refuse_ambiguous(request.headers)
    internal = request.get(INTERNAL)
    tenant = internal[0] if internal is not None else request.app[STATE].keys.tenant_for(
        request.headers.get("Authorization"))
    if tenant is None:
        raise GuardError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")
    request[TENANT] = tenant.name
    return tenant


async def completion(request: web.Request) -> web.StreamResponse:
    ex = Exchange(request, request.app[STATE], request.app[CLIENTS], time.monotonic())
    ex.enter("auth", ex.arrived)
    if tracing.ENABLED:
        ex.trace = tracing.begin(request.headers, request.method, request.path, ex.arrived)
    response: web.StreamResponse | None = None
    refused: GuardError | None = None
    try:
        response = await serve(ex)
        return response
    except GuardError as exc:
        ex.outcome, refused = exc.outcome, exc
        response = error_response(exc.status, exc.message, param=exc.param, code=exc.code,
                                  retry_after=exc.retry_after, headers=exc.headers)
        return response
    finally:
        ex.count_outcome()
        objectives.account(ex)
        keep_record(ex, response, refused)
        if ex.ticket is not None:  # the ticket calls back into the exchange that holds it: break the cycle,
            ex.ticket.on_revoke = None  # so that both go as soon as the request does, not at the next collection
        if ex.trace is not None:
            end_trace(ex, response)


def end_trace(ex: Exchange, response: web.StreamResponse | None) -> None:
    """The request's last facts into its trace, which goes to the exporter (None: the client left)."""
    trace = ex.trace
    assert trace is not None
    trace.status = response.status if response is not None else 499  # nginx's "client closed request"
    trace.tenant = ex.tenant.name if ex.tenant is not None else "unknown"
    trace.outcome = ex.outcome.value
    trace.request_id = ex.request[REQUEST_ID]
    tracing.finish(trace)


async def serve(ex: Exchange) -> web.StreamResponse:
    state, request = ex.state, ex.request
    ex.tenant = tenant = authenticate(request)
    ex.lane = state.config.lanes[tenant.lane] if INTERNAL not in request else request[INTERNAL][1]
    if request.headers.get("X-Stainless-Retry-Count", "0") not in ("", "0"):
        state.metrics.child(state.metrics.client_retries, tenant.name).inc()
    ex.enter("validate", time.monotonic())
    ex.parsed = await parse_request(request, state.config.limits.max_body_bytes)
    check_model(tenant, ex.parsed.model.model, state.pool)
    if ex.trace is not None:
        ex.trace.validated = time.monotonic()
    ex.enter("route", time.monotonic())
    state.update_mode()  # arrivals move saturation between snapshots
    if state.modes.mode != "normal":  # in normal mode everything goes to the pool: nothing to decide
        route = state.router.route(state.modes.mode, ex.lane, state.over_share(tenant), state.pool.any_up())
        if route.kind != "pool":
            return await serve_elsewhere(ex, route)
    try:
        return await serve_pool(ex)
    except UpstreamUnavailable:
        state.update_mode()
        fallback = state.router.fallback()
        if fallback is None:
            raise GuardError(503, "no engine replica is available and no fallback is configured",
                             code="engine_unavailable", retry_after=1, outcome=Outcome.UPSTREAM_ERROR) from None
        return await serve_elsewhere(ex, fallback)


async def serve_pool(ex: Exchange) -> web.StreamResponse:
    """Admission-controlled service on the pool. Raises ``UpstreamUnavailable`` when no replica could be
    sent the request (the caller then tries a fallback)."""
    await ex.state.pool.wait_while_starting()  # a guard that just started may not have heard from its engines
    if (trace := ex.trace) is not None:
        trace.admission = time.monotonic()
    ex.enter("count", time.monotonic())
    admit.refuse_if_confirmed(ex)
    await admit.count(ex)
    ex.enter("size", time.monotonic())
    admit.size(ex)
    admit.make_ticket(ex)
    admit.observe(ex)
    ex.enter("limits", time.monotonic())
    await admit.charge(ex)
    try:
        ex.enter("queue", time.monotonic())
        await admit.queue(ex)
        ex.enter("forward", time.monotonic())
        return await to_pool(ex)
    finally:
        admit.settle(ex)


async def serve_elsewhere(ex: Exchange, route: Route) -> web.StreamResponse:
    """A fallback engine, the static message, or a refusal: outside the pool's admission control."""
    state, tenant, parsed = ex.state, ex.tenant, ex.parsed
    assert tenant is not None and ex.lane is not None and parsed is not None
    if route.kind == "reject":
        if route.name == "no_backend":
            raise GuardError(503, "no engine replica is available and no fallback is usable",
                             code="engine_unavailable", retry_after=1)
        raise GuardError(503, "the service is degraded and this lane does not use fallbacks", code="degraded",
                         retry_after=5)
    ex.enter("fallback", time.monotonic())
    headers = stamp_headers(ex.request, route.name)
    if route.kind == "static":
        ex.outcome = Outcome.FALLBACK
        return static_response(parsed, route.backend.message, headers)
    model = state.fallback_models.get(route.name, parsed.model.model)
    body = parsed.upstream_body(cache_salt=state.keys.cache_salt(tenant), max_tokens=parsed.max_tokens,
                                priority=ex.lane.priority, model=model)
    observer = responses.observer_class(parsed)(on_first_token=lambda now: None, on_gap=lambda gap: None,
                                                strip_usage=parsed.adds_usage)
    try:
        response, outcome = await forward(ex, route.backend.url, route.name, body, observer, route=route.name)
    except UpstreamUnavailable:
        state.fallback_breakers[route.name].record_failure()
        raise GuardError(503, "the engines and the fallback are unavailable", code="engine_unavailable",
                         retry_after=1, outcome=Outcome.UPSTREAM_ERROR) from None
    ex.outcome = Outcome.FALLBACK if outcome is Outcome.COMPLETED else outcome
    return response
