"""The guard's aiohttp application: routes, the stamping middleware and the lifecycle (session, telemetry
subscription, health monitor, graceful shutdown). The request pipeline itself is guard/http/pipeline.py."""

from __future__ import annotations

import asyncio
import logging
import os
import time

import aiohttp
import yarl
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.protocol import StepProgress, TelemetrySnapshot
from guard.admission.dispatch import Dispatcher, Rejected
from guard.admission.gate import AdmissionGate
from guard.config import Backend, GuardConfig
from guard.detect.detector import Detector
from guard.http.auth import KeyStore
from guard.http.errors import error_response
from guard.http.pipeline import authenticate, completion
from guard.http.relay import SHUTTING_DOWN, Relay
from guard.http.tokens import TokenCounter
from guard.http.validate import Invalid
from guard.metrics import GuardMetrics
from guard.pool.monitor import monitor
from guard.pool.routing import CircuitBreaker, ModeMachine, Router
from guard.pool.telemetry import TelemetrySubscriber
from guard.runtime import REQUEST_ID, STATE, TENANT, GuardState

log = logging.getLogger("guard")


@web.middleware
async def identify(request: web.Request, handler) -> web.StreamResponse:
    """Stamp every response, errors included, with the request id and the tenant; count what is in flight."""
    request[REQUEST_ID] = request_id = f"req-{os.urandom(8).hex()}"  # uuid4 costs twice as much
    state = request.app[STATE]
    state.in_flight += 1
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        response = error_response(exc.status, exc.reason)
    finally:
        state.in_flight -= 1
    if not response.prepared:
        response.headers["X-Request-Id"] = request_id
        if TENANT in request:
            response.headers["X-Guard-Tenant"] = request[TENANT]
    return response


async def models(request: web.Request) -> web.StreamResponse:
    """``GET /v1/models`` and ``GET /v1/models/{id}``: authenticated, then the engine's own answer (its 404
    ``model_not_found`` for an id it does not serve included)."""
    state = request.app[STATE]
    try:
        authenticate(request)
    except Invalid as exc:
        return exc.response()
    assert state.session is not None
    timeout = aiohttp.ClientTimeout(total=state.config.upstream.connect_timeout * 2)
    # The raw path, so that an id's escapes (a slash as %2F) reach the engine as the client sent them.
    url = state.config.engine.url.rstrip("/") + request.raw_path.split("?", 1)[0]
    try:
        async with state.session.get(yarl.URL(url, encoded=True), timeout=timeout) as r:
            return web.Response(body=await r.read(), status=r.status, content_type="application/json")
    except (aiohttp.ClientError, TimeoutError):
        return error_response(503, "the engine is unavailable", code="engine_unavailable", retry_after=1)


async def health(request: web.Request) -> web.Response:
    """200 whenever the guard can answer (in any mode: degraded still serves fallbacks); the body says how."""
    state = request.app[STATE]
    return web.json_response({"status": "ok", "mode": state.modes.mode, "primary_up": state.primary_up(),
                              "telemetry_age_s": round(min(state.gate.telemetry_age(), 1e9), 3)})


async def metrics_endpoint(request: web.Request) -> web.Response:
    state = request.app[STATE]
    m, gate = state.metrics, state.gate
    for name, queue in state.dispatcher.fair.tenants.items():
        m.queue_depth.labels(name).set(len(queue))
        m.reserved_blocks.labels(name).set(gate.tenant_reserved(name))
    m.budget_blocks.set(gate.budget)
    m.jain.set(state.dispatcher.fair.jain_index())
    m.telemetry_age.set(min(gate.telemetry_age(), 1e9))
    return web.Response(body=generate_latest(m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(config: GuardConfig) -> web.Application:
    gate = AdmissionGate(config.admission, {t.name for t in config.tenants})
    metrics = GuardMetrics()
    dispatcher = Dispatcher(config, gate)
    metrics.service_tokens.read = lambda: {name: queue.service for name, queue in dispatcher.fair.tenants.items()}
    engines = [config.engine] + [f for f in config.fallbacks if isinstance(f, Backend)]
    breakers = {b.name: CircuitBreaker(b.name, config.routing.failure_threshold, config.routing.cooldown_s)
                for b in engines}
    detector = Detector({t.name: t.weight for t in config.tenants})
    state = GuardState(config, KeyStore(config.tenants, config.secret), gate, dispatcher, metrics,
                       ModeMachine(config.routing), Router(config.fallbacks, breakers), breakers, detector)
    for tenant in config.tenants:
        metrics.suspicion.labels(tenant.name).set(0.0)
        metrics.fs_state.labels(tenant.name).set(0.0)
    # Body size is enforced by parse_request with a JSON 413; aiohttp's own cap is only a backstop.
    app = web.Application(middlewares=[identify], client_max_size=config.limits.max_body_bytes + 1024)
    app[STATE] = state
    app.router.add_post("/v1/completions", completion)
    app.router.add_post("/v1/chat/completions", completion)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{id:.+}", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)
    app.on_startup.append(_start)
    app.on_shutdown.append(_shutdown)
    app.on_cleanup.append(_cleanup)
    return app


async def _start(app: web.Application) -> None:
    state = app[STATE]
    state.started_at = time.monotonic()
    # Far above anything the admission gate lets through, so the connector never becomes a second queue.
    connector = aiohttp.TCPConnector(limit=4096, limit_per_host=0, enable_cleanup_closed=True)
    # No cookie jar: cookies an engine sets must never be stored and sent with another tenant's request
    # (and a jar costs a lookup per request).
    state.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                          cookie_jar=aiohttp.DummyCookieJar())
    state.relay = Relay(state.session, state.config.upstream)
    state.counter = TokenCounter(state.session, state.config.engine.url, state.config.upstream.connect_timeout)

    def on_snapshot(snapshot: TelemetrySnapshot) -> None:
        state.counter.on_model(snapshot.model)
        state.gate.update(snapshot)
        state.heard_from_engine.set()
        state.detector.on_telemetry(snapshot)
        state.dispatcher.pump()
        state.update_mode()

    def on_busy(progress: StepProgress) -> None:  # alive in a long step: liveness, not new numbers
        state.gate.busy(progress.step, progress.step_running_s)
        state.update_mode()

    def on_failure() -> None:  # the telemetry stream cannot reach the engine: count it against the breaker
        state.heard_from_engine.set()
        state.primary.record_failure()
        state.update_mode()

    state.subscriber = TelemetrySubscriber(state.session, state.config.engine.url, on_snapshot, on_busy,
                                           on_failure, state.config.admission.telemetry_stale_s)
    state.tasks = (asyncio.create_task(state.subscriber.run(), name="telemetry"),
                   asyncio.create_task(monitor(state), name="monitor"))


async def _shutdown(app: web.Application) -> None:
    """The listener is already closed. Queued requests, and any that would queue from now on, get 503 now;
    running ones get ``shutdown_timeout`` to finish. Then every upstream connection is dropped, so that each
    stream still open ends with an error event (and each unary request with a 503) before aiohttp, after
    waiting as long again, would cancel the handlers and cut the streams short."""
    state = app[STATE]
    state.dispatcher.reject_all(Rejected(503, "shutting_down", SHUTTING_DOWN, 1))
    deadline = time.monotonic() + state.config.limits.shutdown_timeout
    while state.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if state.in_flight and state.relay is not None and state.session is not None:
        log.warning("shutdown: %d requests still running after %g s; ending them", state.in_flight,
                    state.config.limits.shutdown_timeout)
        state.relay.close_all()
        await state.session.close()  # requests still waiting for their answer's headers


async def _cleanup(app: web.Application) -> None:
    state = app[STATE]
    for task in state.tasks:
        task.cancel()
    await asyncio.gather(*state.tasks, return_exceptions=True)
    if state.session is not None:
        await state.session.close()
