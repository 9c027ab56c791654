"""The completion pipeline: one request from the client's bytes to its final answer, as declared lists of
named stages that one runner drives (guard/http/stages.py):

    REQUEST    auth -> validate -> route
    POOL       count -> size -> ticket -> limits -> queue -> forward                 (admission control)
    ELSEWHERE  fallback                                    (a fallback engine or the static message)

(``INTERNAL_REQUEST`` is ``REQUEST`` for a request the guard makes itself, a batch line: its auth stage takes
the tenant and lane the request carries.)

The names are the decision record's stages. A request runs ``REQUEST``, then ``POOL`` when its route is the
pool, else ``ELSEWHERE``; when no replica could be sent it (``UpstreamUnavailable``), it makes one attempt on
the first usable fallback (``ELSEWHERE`` again). A stage that refuses raises ``GuardError``; ``completion``
turns it into the response. What a stage took (the ticket's reservation, the limits' charge) the runner
gives back in reverse order however the request ends (guard/http/admit.py). Then the end-of-request hooks
run, whatever happened: the request's one ``guard_requests_total`` outcome (every request that reaches the
guard is counted once), its SLO verdicts (guard/http/objectives.py), its decision record
(guard/http/decision.py) and its trace.

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
from guard.http.exchange import Caller, Exchange, stamp_headers
from guard.http.forward import forward, to_pool
from guard.http.models import check_model
from guard.http.stages import Stage, run
from guard.http.static import static_response
from guard.http.validate import ParsedRequest, parse_request
from guard.instance import STATE, GuardState
from guard.pool.routing import Route
from guard.wire.errors import error_response
from guard.wire.relay import UpstreamUnavailable
from guard.wire.stamp import REQUEST_ID, TENANT

# A request the guard makes itself (a batch line, guard/batch/line.py) carries its tenant and lane here, in
# place of an API key; it runs INTERNAL_REQUEST, whose auth stage reads them, so a client's request pays
# nothing for it.
INTERNAL = web.RequestKey("internal", tuple)


def authenticate(request: web.Request, state: GuardState | None = None) -> Tenant:
    """The request's tenant, from its one ``Authorization`` header (a request with two of it, or of another
    header that must come once, is refused first: guard/http/ambiguity.py). ``state``: the app's, when the
    caller has it (the app's lookup is Python code in aiohttp, on every request)."""
    headers = request.headers
    refuse_ambiguous(headers)
    tenant = (state or request.app[STATE]).keys.tenant_for(headers.get("Authorization"))
    if tenant is None:
        raise GuardError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")
    request[TENANT] = tenant.name
    return tenant


def auth(ex: Exchange) -> Caller:
    state = ex.state
    tenant = authenticate(ex.request, state)
    if ex.request.headers.get("X-Stainless-Retry-Count", "0") not in ("", "0"):
        state.metrics.child(state.metrics.client_retries, tenant.name).inc()
    return Caller(tenant, state.config.lanes[tenant.lane])


def internal_auth(ex: Exchange) -> Caller:
    """A request the guard makes itself: its tenant and lane as it was given them (``INTERNAL``)."""
    tenant, lane = ex.request[INTERNAL]
    ex.request[TENANT] = tenant.name
    return Caller(tenant, lane)


async def validate(ex: Exchange) -> ParsedRequest:
    parsed = await parse_request(ex.request, ex.state.config.limits.max_body_bytes)
    check_model(ex.caller.tenant, parsed.model.model, ex.state.pool)
    if ex.trace is not None:
        ex.trace.validated = time.monotonic()
    return parsed


def route(ex: Exchange) -> Route:
    """The pool in normal mode; under pressure or degraded, the mode's route for the request's lane."""
    state = ex.state
    state.update_mode()  # arrivals move saturation between snapshots
    if state.modes.mode != "normal":  # in normal mode everything goes to the pool: nothing to decide
        tenant, lane = ex.caller
        chosen = state.router.route(state.modes.mode, lane, state.over_share(tenant), state.pool.any_up())
        if chosen.kind == "reject":
            if chosen.name == "no_backend":
                raise GuardError(503, "no engine replica is available and no fallback is usable",
                                 code="engine_unavailable", retry_after=1)
            raise GuardError(503, "the service is degraded and this lane does not use fallbacks",
                             code="degraded", retry_after=5)
        if chosen.kind != "pool":
            return chosen
    return POOL_ROUTE


async def elsewhere(ex: Exchange) -> web.StreamResponse:
    """A fallback engine or the static message: outside the pool's admission control."""
    state, route_, parsed, (tenant, lane) = ex.state, ex.route, ex.parsed, ex.caller
    headers = stamp_headers(ex.request, route_.name)
    if route_.kind == "static":
        ex.outcome = Outcome.FALLBACK
        return static_response(parsed, route_.backend.message, headers)
    model = state.fallback_models.get(route_.name, parsed.model.model)
    body = parsed.upstream_body(cache_salt=state.keys.cache_salt(tenant), max_tokens=parsed.max_tokens,
                                priority=lane.priority, model=model)
    observer = responses.observer_class(parsed)(on_first_token=lambda now: None, on_gap=lambda gap: None,
                                                strip_usage=parsed.adds_usage)
    try:
        response, outcome = await forward(ex, route_.backend.url, route_.name, body, observer, route=route_.name)
    except UpstreamUnavailable:
        state.fallback_breakers[route_.name].record_failure()
        raise GuardError(503, "the engines and the fallback are unavailable", code="engine_unavailable",
                         retry_after=1, outcome=Outcome.UPSTREAM_ERROR) from None
    ex.outcome = Outcome.FALLBACK if outcome is Outcome.COMPLETED else outcome
    return response


POOL_ROUTE = Route("pool", "pool")
REQUEST = (Stage("auth", auth, keeps="caller"), Stage("validate", validate, keeps="parsed"),
           Stage("route", route, keeps="route"))
INTERNAL_REQUEST = (Stage("auth", internal_auth, keeps="caller"), *REQUEST[1:])
POOL = (Stage("count", admit.count, keeps="limits"),
        Stage("size", admit.size, keeps="sizing"),
        Stage("ticket", admit.make_ticket, keeps="entry", release=admit.finish_ticket),
        Stage("limits", admit.charge, keeps="charge", release=admit.settle_charge),
        Stage("queue", admit.queue), Stage("forward", to_pool))
ELSEWHERE = (Stage("fallback", elsewhere),)


async def serve(ex: Exchange, request_stages: tuple[Stage, ...]) -> web.StreamResponse:
    """The request's stages (``request_stages``: REQUEST, or INTERNAL_REQUEST for the guard's own): each list
    ends with the stage that answers."""
    if (await run(ex, request_stages)).kind != "pool":
        return await run(ex, ELSEWHERE)
    try:
        return await run(ex, POOL)
    except UpstreamUnavailable:
        ex.state.update_mode()
        fallback = ex.state.router.fallback()
        if fallback is None:
            raise GuardError(503, "no engine replica is available and no fallback is configured",
                             code="engine_unavailable", retry_after=1, outcome=Outcome.UPSTREAM_ERROR) from None
        ex.route = fallback
        return await run(ex, ELSEWHERE)


async def completion(request: web.Request, request_stages: tuple[Stage, ...] = REQUEST) -> web.StreamResponse:
    app = request.app
    ex = Exchange(request, app[STATE], app[CLIENTS], time.monotonic(), request[REQUEST_ID])
    if tracing.ENABLED:
        ex.trace = tracing.begin(request.headers, request.method, request.path, ex.arrived)
    response: web.StreamResponse | None = None
    refused: GuardError | None = None
    try:
        response = await serve(ex, request_stages)
        return response
    except GuardError as exc:
        ex.outcome, refused = exc.outcome, exc
        response = error_response(exc.status, exc.message, param=exc.param, code=exc.code,
                                  retry_after=exc.retry_after, headers=exc.headers)
        return response
    finally:
        ended(ex, response, refused)


def ended(ex: Exchange, response: web.StreamResponse | None, refused: GuardError | None) -> None:
    """The end-of-request hooks, in order, however far the request got: its one outcome, its SLO verdicts,
    its decision record, its trace."""
    count_outcome(ex)
    objectives.account(ex)
    keep_record(ex, response, refused)
    if (entry := getattr(ex, "entry", None)) is not None:  # the ticket calls back into the exchange that holds it:
        entry.ticket.on_revoke = None  # break the cycle, so that both go as soon as the request does
    if ex.trace is not None:
        end_trace(ex, response)


def count_outcome(ex: Exchange) -> None:
    """The one place a request's outcome is counted."""
    metrics, caller = ex.state.metrics, getattr(ex, "caller", None)
    tenant, lane = (caller.tenant.name, caller.tenant.lane) if caller is not None else ("unknown", "none")
    metrics.child(metrics.requests, tenant, lane, ex.outcome).inc()


def end_trace(ex: Exchange, response: web.StreamResponse | None) -> None:
    """The request's last facts into its trace, which goes to the exporter (None: the client left)."""
    trace = ex.trace
    assert trace is not None
    caller = getattr(ex, "caller", None)
    trace.status = response.status if response is not None else 499  # nginx's "client closed request"
    trace.tenant = caller.tenant.name if caller is not None else "unknown"
    trace.outcome = ex.outcome.value
    trace.request_id = ex.request_id
    tracing.finish(trace)
