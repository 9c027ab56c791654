"""The guard's aiohttp application: a pipeline of small stages, each with one job.

    auth -> read + validate -> count tokens -> reserve (fair queue + admission gate) -> relay -> release

Every response carries ``X-Request-Id`` and, once the key is known, ``X-Guard-Tenant``. Every request that
gets past auth ends in exactly one ``guard_requests_total`` outcome, and its reservation is released in a
``finally``: completion, upstream failure and a client that leaves all give the blocks back.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from guard.admission import AdmissionGate
from guard.auth import KeyStore
from guard.config import GuardConfig, Tenant
from guard.dispatch import Dispatcher, Rejected, Ticket
from guard.errors import error_response
from guard.metrics import GuardMetrics
from guard.relay import Relay, StreamObserver, UpstreamUnavailable
from guard.telemetry import TelemetrySubscriber
from guard.validate import Invalid, TokenCounter, parse_request

log = logging.getLogger("guard")


@dataclass(slots=True)
class GuardState:
    config: GuardConfig
    keys: KeyStore
    gate: AdmissionGate
    dispatcher: Dispatcher
    metrics: GuardMetrics
    session: aiohttp.ClientSession | None = None
    relay: Relay | None = None
    counter: TokenCounter | None = None
    subscriber: TelemetrySubscriber | None = None
    tasks: tuple[asyncio.Task, ...] = ()


STATE = web.AppKey("state", GuardState)
REQUEST_ID = web.RequestKey("request_id", str)
TENANT = web.RequestKey("tenant", str)


@web.middleware
async def identify(request: web.Request, handler) -> web.StreamResponse:  # noqa: ANN001 - aiohttp handler
    """Stamp every response, errors included, with the request id and the tenant."""
    request_id = f"req-{uuid.uuid4().hex[:16]}"
    request[REQUEST_ID] = request_id
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        response = error_response(exc.status, exc.reason)
    stamp = {"X-Request-Id": request_id}
    if TENANT in request:
        stamp["X-Guard-Tenant"] = request[TENANT]
    if not response.prepared:
        response.headers.update(stamp)
    return response


def stamp_headers(request: web.Request) -> dict[str, str]:
    """Headers a prepared (streaming) response must carry from the start: the middleware is too late."""
    headers = {"X-Request-Id": request[REQUEST_ID]}
    if TENANT in request:
        headers["X-Guard-Tenant"] = request[TENANT]
    return headers


def authenticate(request: web.Request) -> Tenant:
    state = request.app[STATE]
    tenant = state.keys.tenant_for(request.headers.get("Authorization"))
    if tenant is None:
        state.metrics.requests.labels("unknown", "none", "unauthorized").inc()
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
        metrics.client_retries.labels(tenant.name).inc()
    try:
        assert state.counter is not None
        parsed = await parse_request(request, state.config.limits.max_body_bytes)
        limits = await state.counter.count(parsed)
        blocks = state.gate.blocks_for(limits.prompt_tokens, limits.max_tokens, parsed.n)
        if blocks is None:
            raise Invalid(503, "no telemetry from the engine yet", code="engine_unavailable", retry_after=1)
        if blocks > state.gate.budget:
            raise Invalid(400, f"the request needs {blocks} KV blocks, more than the {state.gate.budget} the guard "
                          "can ever commit; lower max_tokens or shorten the prompt", param="max_tokens")
    except Invalid as exc:
        outcome = "rejected_invalid" if exc.status < 500 else "rejected_overload"
        metrics.requests.labels(*labels, outcome).inc()
        return exc.response()

    ticket = Ticket(request[REQUEST_ID], tenant, lane, limits.prompt_tokens, limits.max_tokens, blocks)
    observer = StreamObserver(
        on_first_token=lambda now: metrics.ttft.labels(tenant.name).observe(now - arrived),
        on_gap=lambda gap: metrics.itl.labels(tenant.name).observe(gap),
    )
    outcome = "cancelled"
    try:
        try:
            await state.dispatcher.submit(ticket)
        except Rejected as exc:
            outcome = "rejected_quota" if exc.status == 429 else "rejected_overload"
            return error_response(exc.status, exc.message, code=exc.code, retry_after=exc.retry_after)
        metrics.queue_wait.labels(tenant.name).observe(time.monotonic() - arrived)
        body = parsed.upstream_body(cache_salt=state.keys.cache_salt(tenant), max_tokens=limits.max_tokens,
                                    priority=lane.priority)
        response, outcome = await forward(request, state, tenant, parsed.path, body, parsed.stream, observer)
        return response
    finally:
        if outcome == "cancelled" and observer.finished:
            outcome = "completed"  # the client hung up after [DONE]: it got everything
        state.dispatcher.charge_output(ticket, observer.output_tokens)
        state.dispatcher.finish(ticket)
        metrics.requests.labels(*labels, outcome).inc()


async def forward(
    request: web.Request, state: GuardState, tenant: Tenant, path: str, body: bytes, stream: bool,
    observer: StreamObserver,
) -> tuple[web.StreamResponse, str]:
    """Send to the engine and relay its answer; ``observer`` learns what reached the client."""
    assert state.relay is not None
    backend = state.config.engine
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity", "X-Tenant-Id": tenant.name,
               "X-Request-Id": request[REQUEST_ID]}
    try:
        upstream = await state.relay.open(backend.url.rstrip("/") + path, body, headers)
    except UpstreamUnavailable:
        state.metrics.upstream_requests.labels(backend.name, "error").inc()
        return error_response(503, "the engine is unavailable", code="engine_unavailable", retry_after=1), \
            "upstream_error"
    except (TimeoutError, aiohttp.ClientError) as exc:
        state.metrics.upstream_requests.labels(backend.name, "error").inc()
        status = 504 if isinstance(exc, TimeoutError) else 502
        return error_response(status, f"the engine failed: {type(exc).__name__}", code="upstream_error"), \
            "upstream_error"
    state.metrics.upstream_requests.labels(backend.name, str(upstream.status)).inc()
    out_headers = stamp_headers(request)
    if not stream:
        response, parsed = await state.relay.unary(upstream, out_headers)
        observer.completion_tokens = int(((parsed or {}).get("usage") or {}).get("completion_tokens", 0) or 0)
        return response, "completed" if response.status == 200 else "upstream_error"
    response = await state.relay.stream(request, upstream, out_headers, observer)
    ok = response.status == 200 and not observer.failed
    return response, "completed" if ok else "upstream_error"


async def models(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    try:
        authenticate(request)
    except Invalid as exc:
        return exc.response()
    assert state.session is not None
    try:
        async with state.session.get(state.config.engine.url.rstrip("/") + "/v1/models",
                                     timeout=aiohttp.ClientTimeout(total=state.config.upstream.connect_timeout * 2)) as r:
            return web.Response(body=await r.read(), status=r.status, content_type="application/json")
    except (aiohttp.ClientError, TimeoutError):
        return error_response(503, "the engine is unavailable", code="engine_unavailable", retry_after=1)


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"status": "ok", "mode": "normal", "engine_telemetry": state.gate.usable,
                              "telemetry_age_s": round(min(state.gate.telemetry_age(), 1e9), 3)})


async def metrics_endpoint(request: web.Request) -> web.Response:
    state = request.app[STATE]
    refresh_gauges(state)
    return web.Response(body=generate_latest(state.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def refresh_gauges(state: GuardState) -> None:
    m, gate = state.metrics, state.gate
    for name, queue in state.dispatcher.fair.tenants.items():
        m.queue_depth.labels(name).set(len(queue))
        m.reserved_blocks.labels(name).set(gate.tenant_reserved(name))
    m.budget_blocks.set(gate.budget)
    m.jain.set(state.dispatcher.fair.jain_index())
    m.telemetry_age.set(min(gate.telemetry_age(), 1e9))
    m.backend_healthy.labels(state.config.engine.name).set(1.0 if gate.usable else 0.0)


def create_app(config: GuardConfig) -> web.Application:
    gate = AdmissionGate(config.admission, {t.name for t in config.tenants})
    metrics = GuardMetrics()
    dispatcher = Dispatcher(config, gate, lambda tenant, service: metrics.service_tokens.labels(tenant).inc(service))
    state = GuardState(config, KeyStore(config.tenants, config.secret), gate, dispatcher, metrics)
    # Body size is enforced by parse_request with a JSON 413; aiohttp's own cap is only a backstop.
    app = web.Application(middlewares=[identify], client_max_size=config.limits.max_body_bytes + 1024)
    app[STATE] = state
    app.router.add_post("/v1/completions", completion)
    app.router.add_post("/v1/chat/completions", completion)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)
    app.on_startup.append(_start)
    app.on_shutdown.append(_shutdown)
    app.on_cleanup.append(_cleanup)
    return app


async def _start(app: web.Application) -> None:
    state = app[STATE]
    # Far above anything the admission gate lets through, so the connector never becomes a second queue.
    connector = aiohttp.TCPConnector(limit=4096, limit_per_host=0, enable_cleanup_closed=True)
    state.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
    state.relay = Relay(state.session, state.config.upstream)
    state.counter = TokenCounter(state.session, state.config.engine.url, state.config.upstream.connect_timeout)

    def on_snapshot(snapshot) -> None:  # noqa: ANN001 - TelemetrySnapshot
        state.gate.update(snapshot)
        state.dispatcher.pump()

    state.subscriber = TelemetrySubscriber(state.session, state.config.engine.url, on_snapshot,
                                           state.config.admission.telemetry_stale_s)
    state.tasks = (asyncio.create_task(state.subscriber.run(), name="telemetry"),)


async def _shutdown(app: web.Application) -> None:
    """The listener is already closed: queued requests get 503 now; running ones get the shutdown timeout."""
    app[STATE].dispatcher.reject_all(Rejected(503, "shutting_down", "the guard is shutting down", 1))


async def _cleanup(app: web.Application) -> None:
    state = app[STATE]
    for task in state.tasks:
        task.cancel()
    await asyncio.gather(*state.tasks, return_exceptions=True)
    if state.session is not None:
        await state.session.close()

