"""The completion pipeline: one request from the client's bytes to its final answer.

    authenticate -> parse -> route by mode -> count -> escalate -> limits (rpm, tpm) -> admit (fair queue,
    picker, a replica's gate) -> forward (relay) -> release

The stages share one ``Exchange`` (the request as it goes through them). A stage that refuses raises
``GuardError``; ``completion`` turns it into the response, and records the request's one
``guard_requests_total`` outcome in its ``finally``: every request that reaches the guard is counted once,
however it ends. A reservation is released in a ``finally`` too: completion, upstream failure and a client
that leaves all give the blocks back; so is a rate-limit charge settled, once, to what the request used
(guard/admission/limits.py). A replica that cannot be reached before a single byte was sent to it
(refused or unaccepted connection) has its circuit opened at once, and the request is admitted again on
the replicas left; when none is left, it makes one attempt on the first usable fallback.

Tracing (guard/tracing.py): with ``tracing.ENABLED``, the ``Exchange`` carries a ``GuardTrace`` and the
stages store their timestamps in it; without, ``ex.trace`` is None and each stage's only cost is that test.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from guard import tracing
from guard.admission.dispatch import Ticket, TicketState
from guard.admission.limits import Charge
from guard.config import Lane, Tenant
from guard.errors import GuardError, Outcome
from guard.http.context import CLIENTS, REQUEST_ID, STATE, TENANT, Clients, GuardState
from guard.http.errors import error_response
from guard.http.relay import StreamObserver, UpstreamUnavailable
from guard.http.static import static_response
from guard.http.validate import ParsedRequest, parse_request
from guard.pool.gate import BORROWED_PRIORITY, batch_blocks_for
from guard.pool.prefix_index import prompt_block_hashes
from guard.pool.routing import Route


@dataclass(slots=True)
class Exchange:
    """One request on its way through the pipeline; the stages fill it in as they pass it on."""

    request: web.Request
    state: GuardState
    clients: Clients
    arrived: float
    tenant: Tenant | None = None  # once authenticated
    lane: Lane | None = None  # the tenant's, resolved with it (a reload may change the lanes meanwhile)
    parsed: ParsedRequest | None = None  # once validated
    charge: Charge | None = None  # once charged to its tenant's rate limits (None: a tenant without any)
    outcome: Outcome = Outcome.CANCELLED  # until a stage knows better: a client that left ends here
    trace: tracing.GuardTrace | None = None  # only while tracing is on
    upstream: aiohttp.ClientResponse | None = None  # the answer being relayed, once the engine sent headers
    revoked: GuardError | None = None  # why the guard took the request's blocks back, if it did

    def revoke(self, reason: GuardError) -> None:
        """The guard ends this admitted request (guard/admission/dispatch.py, ``revoke``): its upstream
        request is dropped, and the client is told ``reason``."""
        self.revoked = reason
        if self.upstream is not None:
            self.clients.relay.revoke(self.upstream, reason)

    def record(self) -> None:
        """The one place a request's outcome is counted."""
        metrics = self.state.metrics
        tenant, lane = (self.tenant.name, self.tenant.lane) if self.tenant is not None else ("unknown", "none")
        metrics.child(metrics.requests, tenant, lane, self.outcome).inc()


def stamp_headers(request: web.Request, route: str | None = None) -> dict[str, str]:
    """Headers a prepared (streaming) response must carry from the start: the middleware is too late."""
    headers = {"X-Request-Id": request[REQUEST_ID]}
    if TENANT in request:
        headers["X-Guard-Tenant"] = request[TENANT]
    if route is not None:
        headers["X-Guard-Route"] = route
    return headers


def authenticate(request: web.Request) -> Tenant:
    tenant = request.app[STATE].keys.tenant_for(request.headers.get("Authorization"))
    if tenant is None:
        raise GuardError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")
    request[TENANT] = tenant.name
    return tenant


async def completion(request: web.Request) -> web.StreamResponse:
    ex = Exchange(request, request.app[STATE], request.app[CLIENTS], time.monotonic())
    if tracing.ENABLED:
        ex.trace = tracing.begin(request.headers, request.method, request.path, ex.arrived)
    response: web.StreamResponse | None = None
    try:
        response = await serve(ex)
        return response
    except GuardError as exc:
        ex.outcome = exc.outcome
        response = error_response(exc.status, exc.message, param=exc.param, code=exc.code,
                                  retry_after=exc.retry_after, headers=exc.headers)
        return response
    finally:
        ex.record()
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
    ex.lane = state.config.lanes[tenant.lane]
    if request.headers.get("X-Stainless-Retry-Count", "0") not in ("", "0"):
        state.metrics.child(state.metrics.client_retries, tenant.name).inc()
    ex.parsed = await parse_request(request, state.config.limits.max_body_bytes)
    if ex.trace is not None:
        ex.trace.validated = time.monotonic()
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
    state, tenant, parsed = ex.state, ex.tenant, ex.parsed
    assert tenant is not None and ex.lane is not None and parsed is not None  # set by the stages before
    pool, metrics = state.pool, state.metrics
    await pool.wait_while_starting()  # a guard that just started may not have heard from its engines yet
    if (trace := ex.trace) is not None:
        trace.admission = time.monotonic()
    if state.escalation.confirmed(tenant.name):  # refused before its prompt costs a tokenization
        declared = parsed.max_tokens
        state.escalation.refuse(tenant, declared if declared is not None else
                                state.predictor.predict(tenant.name, tenant.lane, sys.maxsize))
    try:
        limits = await ex.clients.counter.count(parsed)
    except GuardError as exc:
        if exc.code == "engine_unavailable":
            raise UpstreamUnavailable(exc.message) from None
        raise
    block_size = pool.block_size()
    if block_size is None:
        raise UpstreamUnavailable("no telemetry from any engine replica yet")
    declared = parsed.max_tokens is not None
    bound = limits.max_tokens  # what each sequence may generate: the client's bound, or the context's room
    # Without a bound of its own a request reserves what such requests generate, not the whole room.
    reserve = bound if declared else state.predictor.predict(tenant.name, tenant.lane, bound)
    cap, lane = state.escalation.shape(tenant, ex.lane, reserve)
    if cap is not None:
        bound, reserve = min(bound, cap), min(reserve, cap)
    blocks = batch_blocks_for(block_size, limits.prompts, reserve, parsed.n)
    while not declared and reserve > 1 and blocks > pool.largest_budget():  # a prediction must fit a replica
        reserve //= 2
        blocks = batch_blocks_for(block_size, limits.prompts, reserve, parsed.n)
    if blocks > pool.largest_budget():
        raise GuardError(400, f"the request needs {blocks} KV blocks, more than the {pool.largest_budget()} the "
                         "guard can ever commit on one engine; lower max_tokens or shorten the prompt",
                         param="max_tokens")
    salt = state.keys.cache_salt(tenant)
    hashes = ([prompt_block_hashes(ids, block_size, salt) for ids in limits.ids]
              if state.picker.needs_hashes and len(pool) > 1 and limits.ids is not None else [])
    ticket = Ticket(ex.request[REQUEST_ID], tenant, lane, limits.prompt_tokens, reserve, blocks, hashes,
                    on_revoke=ex.revoke)
    sequences = len(limits.prompts) * parsed.n  # a stream's token events are theirs, interleaved
    grow_at = reserve * sequences  # token events past which the reservation no longer covers the output

    def on_gap(gap: float) -> None:
        """Each token after the first: a stream that outgrows its predicted reservation asks for more."""
        nonlocal grow_at
        itl.observe(gap)
        if observer.events < grow_at or ticket.max_tokens >= bound:
            return
        wanted = min(bound, 2 * ticket.max_tokens)
        granted = state.dispatcher.grow(ticket, batch_blocks_for(block_size, limits.prompts, wanted, parsed.n),
                                        wanted)
        metrics.child(metrics.reservation_growths, "granted" if granted else "denied").inc()
        # Denied: ask again a block later, when some other request may have ended.
        grow_at = ticket.max_tokens * sequences if granted else grow_at + block_size * sequences

    ttft, itl = metrics.child(metrics.ttft, tenant.name), metrics.child(metrics.itl, tenant.name)
    observer = StreamObserver(on_first_token=lambda now: ttft.observe(now - ex.arrived),
                              on_gap=itl.observe if declared else on_gap, strip_usage=parsed.adds_usage)
    # Limits come before the fair queue and the KV budget: charged what the reservation covers, now.
    ex.charge = charge = await state.limiter.charge(tenant, limits.prompt_tokens + reserve * sequences)
    try:
        if trace is not None:
            trace.queued, trace.blocks = time.monotonic(), blocks
        await state.dispatcher.submit(ticket)
        admitted = time.monotonic()
        metrics.child(metrics.queue_wait, tenant.name).observe(admitted - ex.arrived)
        if trace is not None:
            trace.admitted, trace.waited = admitted, ticket.enqueued_at > 0.0
        while True:
            replica = ticket.replica
            assert replica is not None  # admitted
            if ex.revoked is not None:
                raise ex.revoked
            # A client's own bound, or a suspect's cap, goes upstream; otherwise none, and the engine bounds
            # the output by its window and its own pool (which may hold fewer tokens than the window). A
            # ticket that borrows runs at a lower engine priority, so the engine preempts borrowers first.
            body = parsed.upstream_body(cache_salt=salt, max_tokens=bound if declared or cap is not None else None,
                                        priority=lane.priority + (BORROWED_PRIORITY if ticket.borrowed else 0))
            metrics.child(metrics.routed, replica.name).inc()
            metrics.child(metrics.prefix_predicted, replica.name).inc(ticket.hit_blocks * block_size)
            try:
                response, ex.outcome = await forward(ex, replica.url, replica.name, body, observer, route=None)
                return response
            except UpstreamUnavailable:
                replica.breaker.trip()  # nothing listens there: no request should try it again until healthy
                state.dispatcher.finish(ticket)
                if not pool.any_usable():
                    raise
                ticket = dataclasses.replace(ticket, state=TicketState.NEW, admitted=None, replica=None)
                await state.dispatcher.submit(ticket)
    finally:
        if ex.outcome is Outcome.CANCELLED and observer.finished:
            ex.outcome = Outcome.COMPLETED  # the client hung up after [DONE]: it got everything
        if ex.outcome is Outcome.COMPLETED and not declared:
            state.predictor.record(tenant.name, tenant.lane, -(-observer.output_tokens // sequences))
        if charge is not None:  # a ticket still admitted reached an engine; any other gives its charge back
            charge.settle(limits.prompt_tokens + observer.output_tokens if ticket.state is TicketState.ADMITTED
                          else None)
        state.dispatcher.charge_output(ticket, observer.output_tokens)
        state.dispatcher.finish(ticket)


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
    headers = stamp_headers(ex.request, route.name)
    if route.kind == "static":
        ex.outcome = Outcome.FALLBACK
        return static_response(parsed, route.backend.message, headers)
    model = state.fallback_models.get(route.name, parsed.model.model)
    body = parsed.upstream_body(cache_salt=state.keys.cache_salt(tenant), max_tokens=parsed.max_tokens,
                                priority=ex.lane.priority, model=model)
    observer = StreamObserver(on_first_token=lambda now: None, on_gap=lambda gap: None,
                              strip_usage=parsed.adds_usage)
    try:
        response, outcome = await forward(ex, route.backend.url, route.name, body, observer, route=route.name)
    except UpstreamUnavailable:
        state.fallback_breakers[route.name].record_failure()
        raise GuardError(503, "the engines and the fallback are unavailable", code="engine_unavailable",
                         retry_after=1, outcome=Outcome.UPSTREAM_ERROR) from None
    ex.outcome = Outcome.FALLBACK if outcome is Outcome.COMPLETED else outcome
    return response


async def forward(
    ex: Exchange, url: str, backend: str, body: bytes, observer: StreamObserver, route: str | None,
) -> tuple[web.StreamResponse, Outcome]:
    """Send to an engine and relay its answer. Raises ``UpstreamUnavailable`` if nothing could be sent."""
    state, relay, parsed, tenant = ex.state, ex.clients.relay, ex.parsed, ex.tenant
    assert parsed is not None and tenant is not None
    metrics = state.metrics
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity", "X-Tenant-Id": tenant.name,
               "X-Request-Id": ex.request[REQUEST_ID]}
    breaker = state.pool.by_name[backend].breaker if backend in state.pool.by_name else \
        state.fallback_breakers[backend]
    if (trace := ex.trace) is not None:
        trace.upstream = trace.upstream or time.monotonic()  # a retry on another replica extends the span
        trace.backend = backend
        headers.update(trace.upstream_headers())
    try:
        upstream = await relay.open(url.rstrip("/") + parsed.path, body, headers, parsed.stream)
    except UpstreamUnavailable:
        metrics.child(metrics.upstream_requests, backend, "error").inc()
        if trace is not None:
            trace.unavailable += ((time.monotonic(), backend),)
        raise
    except (TimeoutError, aiohttp.ClientError) as exc:
        metrics.child(metrics.upstream_requests, backend, "error").inc()
        breaker.record_failure()
        if isinstance(exc, TimeoutError):  # as relay.stream says it when the headers came but no token
            message = ("the engine sent no token within the first-token timeout" if parsed.stream
                       else "the engine did not answer within the unary timeout")
            return relay.failure(504, message, "upstream_timeout"), Outcome.UPSTREAM_ERROR
        return relay.failure(502, f"the engine failed: {type(exc).__name__}", "upstream_error"), \
            Outcome.UPSTREAM_ERROR
    ex.upstream = upstream
    if ex.revoked is not None:  # revoked while its headers were on their way
        relay.revoke(upstream, ex.revoked)
    metrics.child(metrics.upstream_requests, backend, str(upstream.status)).inc()
    if trace is not None:
        trace.headers, trace.upstream_status = time.monotonic(), upstream.status
    if upstream.status >= 500:
        breaker.record_failure()
    else:
        breaker.record_success()
    out_headers = stamp_headers(ex.request, route)
    out_headers["X-Guard-Backend"] = backend
    if ex.charge is not None:  # a limited tenant paces itself by these, on every answer
        out_headers.update(ex.charge.headers())
    if not parsed.stream:
        response, answer = await relay.unary(upstream, out_headers)
        if trace is not None:
            trace.upstream_end = time.monotonic()
        observer.completion_tokens = int(((answer or {}).get("usage") or {}).get("completion_tokens", 0) or 0)
        if ex.revoked is not None and response.status != 200:
            return response, ex.revoked.outcome
        return response, Outcome.COMPLETED if response.status == 200 else Outcome.UPSTREAM_ERROR
    response = await relay.stream(ex.request, upstream, out_headers, observer)
    if trace is not None:
        trace.upstream_end, trace.first_token = time.monotonic(), observer.first_at
        trace.token_events = observer.events
    if observer.client_gone:
        return response, Outcome.CANCELLED
    if ex.revoked is not None and (observer.failed or response.status != 200):
        return response, ex.revoked.outcome
    ok = response.status == 200 and not observer.failed
    return response, Outcome.COMPLETED if ok else Outcome.UPSTREAM_ERROR
