"""The completion pipeline: one request from the client's bytes to its final answer.

    auth -> read + validate -> route by mode -> count tokens -> reserve (fair queue + gate) -> relay -> release

Every request that gets past auth ends in exactly one ``guard_requests_total`` outcome, and its reservation
is released in a ``finally``: completion, upstream failure and a client that leaves all give the blocks back.
When the primary engine cannot be reached before a single byte was sent to it (refused connection, or its
tokenizer endpoint is down), the request makes one attempt on the first usable fallback.
"""

from __future__ import annotations

import time

import aiohttp
from aiohttp import web

from guard.admission.dispatch import Rejected, Ticket
from guard.config import Lane, Tenant
from guard.http.errors import error_response
from guard.http.relay import StreamObserver, UpstreamUnavailable
from guard.http.static import static_response
from guard.http.validate import Invalid, ParsedRequest, parse_request
from guard.pool.routing import Route
from guard.runtime import (
    ABUSE_CODE,
    ABUSE_MESSAGE,
    ABUSE_RETRY_AFTER_S,
    REQUEST_ID,
    STATE,
    SUSPECT_MAX_TOKENS,
    TENANT,
    GuardState,
)


def stamp_headers(request: web.Request, route: str | None = None) -> dict[str, str]:
    """Headers a prepared (streaming) response must carry from the start: the middleware is too late."""
    headers = {"X-Request-Id": request[REQUEST_ID]}
    if TENANT in request:
        headers["X-Guard-Tenant"] = request[TENANT]
    if route is not None:
        headers["X-Guard-Route"] = route
    return headers


def authenticate(request: web.Request) -> Tenant:
    state = request.app[STATE]
    tenant = state.keys.tenant_for(request.headers.get("Authorization"))
    if tenant is None:
        state.metrics.child(state.metrics.requests, "unknown", "none", "unauthorized").inc()
        raise Invalid(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")
    request[TENANT] = tenant.name
    return tenant


async def completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    metrics = state.metrics
    arrived = time.monotonic()
    try:
        tenant = authenticate(request)
    except Invalid as exc:
        return exc.response()
    lane = state.config.lanes[tenant.lane]
    labels = (tenant.name, tenant.lane)
    if request.headers.get("X-Stainless-Retry-Count", "0") not in ("", "0"):
        metrics.child(metrics.client_retries, tenant.name).inc()
    try:
        parsed = await parse_request(request, state.config.limits.max_body_bytes)
    except Invalid as exc:
        metrics.child(metrics.requests, *labels, "rejected_invalid").inc()
        return exc.response()
    state.update_mode()  # arrivals move saturation between snapshots
    if state.modes.mode != "normal":  # in normal mode everything goes to the primary: nothing to decide
        route = state.router.route(state.modes.mode, lane, state.over_share(tenant), state.primary_up())
        if route.kind != "primary":
            return await serve_elsewhere(request, state, tenant, parsed, route, labels)
    try:
        return await serve_primary(request, state, tenant, lane, parsed, labels, arrived)
    except UpstreamUnavailable:
        state.primary.record_failure()
        state.update_mode()
        fallback = state.router.fallback()
        if fallback is None:
            metrics.child(metrics.requests, *labels, "upstream_error").inc()
            return error_response(503, "the engine is unavailable and no fallback is configured",
                                  code="engine_unavailable", retry_after=1)
        return await serve_elsewhere(request, state, tenant, parsed, fallback, labels)


async def serve_primary(
    request: web.Request, state: GuardState, tenant: Tenant, lane: Lane, parsed: ParsedRequest,
    labels: tuple[str, str], arrived: float,
) -> web.StreamResponse:
    """Admission-controlled service on the primary. Raises ``UpstreamUnavailable`` when nothing was sent."""
    metrics = state.metrics
    assert state.counter is not None
    await state.wait_while_starting()  # a guard that just started may not have heard from its engine yet
    try:
        limits = await state.counter.count(parsed)
        blocks = state.gate.batch_blocks_for(limits.prompts, limits.max_tokens, parsed.n)
        if blocks is None:
            raise Invalid(503, "no telemetry from the engine yet", code="engine_unavailable", retry_after=1)
        if blocks > state.gate.budget:
            raise Invalid(400, f"the request needs {blocks} KV blocks, more than the {state.gate.budget} the guard "
                          "can ever commit; lower max_tokens or shorten the prompt", param="max_tokens")
    except Invalid as exc:
        if exc.code == "engine_unavailable":
            raise UpstreamUnavailable(exc.message) from None
        metrics.child(metrics.requests, *labels, "rejected_invalid" if exc.status < 500 else "rejected_overload").inc()
        return exc.response()
    state.detector.on_request(tenant.name, limits.max_tokens)
    suspicion = state.detector.state(tenant.name)
    if suspicion == "confirmed":
        metrics.child(metrics.requests, *labels, "rejected_quota").inc()
        return error_response(429, ABUSE_MESSAGE, code=ABUSE_CODE, retry_after=ABUSE_RETRY_AFTER_S)
    if suspicion == "suspect":  # escalate: fewer tokens, a smaller share of blocks, served last
        limits.max_tokens = min(limits.max_tokens, SUSPECT_MAX_TOKENS)
        blocks = state.gate.batch_blocks_for(limits.prompts, limits.max_tokens, parsed.n) or blocks
        lane = lane.model_copy(update={"priority": max(ln.priority for ln in state.config.lanes.values()) + 1})

    ticket = Ticket(request[REQUEST_ID], tenant, lane, limits.prompt_tokens, limits.max_tokens, blocks)
    ttft, itl = metrics.child(metrics.ttft, tenant.name), metrics.child(metrics.itl, tenant.name)
    observer = StreamObserver(on_first_token=lambda now: ttft.observe(now - arrived), on_gap=itl.observe)
    outcome = "cancelled"
    try:
        try:
            await state.dispatcher.submit(ticket)
        except Rejected as exc:
            outcome = "rejected_quota" if exc.status == 429 else "rejected_overload"
            return error_response(exc.status, exc.message, code=exc.code, retry_after=exc.retry_after)
        metrics.child(metrics.queue_wait, tenant.name).observe(time.monotonic() - arrived)
        body = parsed.upstream_body(cache_salt=state.keys.cache_salt(tenant), max_tokens=limits.max_tokens,
                                    priority=lane.priority)
        try:
            response, outcome = await forward(request, state, state.config.engine.url, state.config.engine.name,
                                              tenant, parsed, body, observer, route=None)
        except UpstreamUnavailable:
            outcome = "fallback"  # nothing reached the engine; the caller retries on a fallback
            raise
        return response
    finally:
        if outcome == "cancelled" and observer.finished:
            outcome = "completed"  # the client hung up after [DONE]: it got everything
        state.dispatcher.charge_output(ticket, observer.output_tokens)
        state.dispatcher.finish(ticket)
        if outcome != "fallback":
            metrics.child(metrics.requests, *labels, outcome).inc()


async def serve_elsewhere(
    request: web.Request, state: GuardState, tenant: Tenant, parsed: ParsedRequest, route: Route,
    labels: tuple[str, str],
) -> web.StreamResponse:
    """A fallback engine, the static message, or a refusal: outside the primary's admission control."""
    metrics = state.metrics
    outcome = "cancelled"
    try:
        if route.kind == "reject":
            outcome = "rejected_overload"
            if route.name == "no_backend":
                return error_response(503, "the engine is unavailable and no fallback is usable",
                                      code="engine_unavailable", retry_after=1)
            return error_response(503, "the service is degraded and this lane does not use fallbacks",
                                  code="degraded", retry_after=5)
        headers = stamp_headers(request, route.name)
        if route.kind == "static":
            outcome = "fallback"
            return static_response(request, parsed.path, route.backend.message, parsed.stream, headers)
        model = state.fallback_models.get(route.name, parsed.model.model)
        body = parsed.upstream_body(cache_salt=state.keys.cache_salt(tenant), max_tokens=parsed.max_tokens,
                                    priority=state.config.lanes[tenant.lane].priority, model=model)
        observer = StreamObserver(on_first_token=lambda now: None, on_gap=lambda gap: None)
        try:
            response, result = await forward(request, state, route.backend.url, route.name, tenant, parsed, body,
                                             observer, route=route.name)
        except UpstreamUnavailable:
            state.breakers[route.name].record_failure()
            outcome = "upstream_error"
            return error_response(503, "the engine and its fallback are unavailable", code="engine_unavailable",
                                  retry_after=1)
        outcome = "fallback" if result == "completed" else result
        return response
    finally:
        metrics.child(metrics.requests, *labels, outcome).inc()


async def forward(
    request: web.Request, state: GuardState, url: str, backend: str, tenant: Tenant, parsed: ParsedRequest,
    body: bytes, observer: StreamObserver, route: str | None,
) -> tuple[web.StreamResponse, str]:
    """Send to an engine and relay its answer. Raises ``UpstreamUnavailable`` if nothing could be sent."""
    assert state.relay is not None
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity", "X-Tenant-Id": tenant.name,
               "X-Request-Id": request[REQUEST_ID]}
    breaker = state.breakers[backend]
    try:
        upstream = await state.relay.open(url.rstrip("/") + parsed.path, body, headers, parsed.stream)
    except UpstreamUnavailable:
        state.metrics.child(state.metrics.upstream_requests, backend, "error").inc()
        raise
    except (TimeoutError, aiohttp.ClientError) as exc:
        state.metrics.child(state.metrics.upstream_requests, backend, "error").inc()
        breaker.record_failure()
        if isinstance(exc, TimeoutError):  # as relay.stream says it when the headers came but no token
            message = ("the engine sent no token within the first-token timeout" if parsed.stream
                       else "the engine did not answer within the unary timeout")
            return state.relay.failure(504, message, "upstream_timeout"), "upstream_error"
        return state.relay.failure(502, f"the engine failed: {type(exc).__name__}", "upstream_error"), \
            "upstream_error"
    state.metrics.child(state.metrics.upstream_requests, backend, str(upstream.status)).inc()
    if upstream.status >= 500:
        breaker.record_failure()
    else:
        breaker.record_success()
    out_headers = stamp_headers(request, route)
    if not parsed.stream:
        response, answer = await state.relay.unary(upstream, out_headers)
        observer.completion_tokens = int(((answer or {}).get("usage") or {}).get("completion_tokens", 0) or 0)
        return response, "completed" if response.status == 200 else "upstream_error"
    response = await state.relay.stream(request, upstream, out_headers, observer)
    if observer.client_gone:
        return response, "cancelled"
    ok = response.status == 200 and not observer.failed
    return response, "completed" if ok else "upstream_error"
