"""The guard's aiohttp application built from its config, and its lifecycle (client session, each replica's
telemetry and KV-event subscriptions, the health monitor, graceful shutdown). The handlers are
guard/http/routes.py and the request pipeline guard/http/pipeline.py. Serve the app with guard/wire/connections.py's ``GuardRunner``
(``serve`` in a process), which puts client connections under deadlines and a cap."""

from __future__ import annotations

import asyncio
import functools
import logging

import aiohttp
from aiohttp import web

from engine.protocol import StepProgress, TelemetrySnapshot
from guard import tracing
from guard.admission.dispatch import Dispatcher
from guard.auth import KeyStore
from guard.batch.install import install as install_batch
from guard.config import Backend, GuardConfig, config_hash
from guard.console.app import install as install_console
from guard.detect.detector import Detector
from guard.detect.escalation import Escalation
from guard.errors import GuardError
from guard.http.clients import CLIENTS, Clients
from guard.http.migrate import watch_silence
from guard.http.models import learn_adapters
from guard.http.pipeline import completion
from guard.http.routes import answered, health, identify, metrics_endpoint, models
from guard.http.stored import stored
from guard.http.tokens import TokenCounter
from guard.instance import STATE, GuardState
from guard.metrics import GuardMetrics
from guard.pool.gate import AdmissionGate
from guard.pool.kv_events import KVEventSubscriber
from guard.pool.pool import ReplicaPool
from guard.pool.replica import Replica
from guard.pool.routing import CircuitBreaker, ModeMachine, Router
from guard.pool.scheduling import profile_for
from guard.pool.telemetry import TelemetrySubscriber
from guard.records.log import DecisionLog
from guard.server.autoscale import publish as publish_autoscaling
from guard.server.monitor import monitor
from guard.state.ledger import RedisLedger
from guard.state.shared import SharedState
from guard.state.verdicts import share_verdicts
from guard.wire.connections import CONNECTIONS, ConnectionGuard
from guard.wire.front import FrontConnection
from guard.wire.relay import SHUTTING_DOWN, Relay
from guard.wire.upstream import UpstreamClient

log = logging.getLogger("guard")


def create_app(config: GuardConfig, *, console: bool = True, worker: int | None = None) -> web.Application:
    """The guard's application; ``console`` False leaves out the admin listener even when ``admin`` is
    configured (every worker but the first of ``--workers N``); ``worker``: this process's index among them."""
    guard_tenants = {t.name for t in config.tenants}
    routing = config.routing

    def breaker(backend: Backend) -> CircuitBreaker:
        return CircuitBreaker(backend.name, routing.failure_threshold, routing.cooldown_s)

    pool = ReplicaPool([Replica(b, AdmissionGate(config.admission, guard_tenants), breaker(b)) for b in config.pool])
    fallback_breakers = {f.name: breaker(f) for f in config.fallbacks if isinstance(f, Backend)}
    metrics = GuardMetrics()
    metrics.show_config(config_hash(config))
    profile = profile_for(routing)
    shared = SharedState(config.shared_state, metrics) if config.shared_state is not None else None
    dispatcher = Dispatcher(config, pool, profile, None if shared is None else RedisLedger(shared, pool))
    metrics.service_tokens.read = lambda: {name: queue.service for name, queue in dispatcher.fair.tenants.items()}
    detector = Detector({t.name: t.weight for t in config.tenants})
    state = GuardState(config, KeyStore(config.tenants, config.secret), pool, profile, dispatcher, metrics,
                       ModeMachine(routing), Router(config.fallbacks, fallback_breakers), fallback_breakers,
                       detector, Escalation(detector, dispatcher, pool, metrics, config.lanes), shared=shared,
                       decision_log=DecisionLog(config.decision_log, worker=worker) if config.decision_log else None)
    for replica in pool:  # every replica's series exist from the start, at 0
        for counter in (metrics.routed, metrics.prefix_predicted, metrics.prefix_reported_hits,
                        metrics.prefix_reported_queries):
            counter.labels(replica.name)
    # Body size is enforced by parse_request with a JSON 413; aiohttp's own cap is only a backstop.
    # One middleware: identify also tells the connection's deadlines (wire/connections.py) when a request
    # begins and ends.
    app = web.Application(middlewares=[identify], client_max_size=config.limits.max_body_bytes + 1024)
    app[STATE] = state
    app[CONNECTIONS] = connections = ConnectionGuard(config.connections, metrics)
    # The completion routes skip aiohttp's server: the front serves them with the same pipeline.
    connections.front = functools.partial(FrontConnection, app, functools.partial(answered, completion),
                                          config.limits.max_body_bytes)
    app.router.add_post("/v1/completions", completion)
    app.router.add_post("/v1/chat/completions", completion)
    app.router.add_post("/v1/responses", completion)
    app.router.add_get("/v1/responses/{id}", stored)
    app.router.add_delete("/v1/responses/{id}", stored)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{id:.+}", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_endpoint)
    app.on_startup.append(_start)
    app.on_shutdown.append(_shutdown)
    app.on_cleanup.append(_cleanup)
    if config.batch is not None:
        install_batch(app)  # /v1/files and /v1/batches, and the runner (after the app's own hooks)
    if config.admin is not None and console:
        install_console(app, config.admin)  # the admin listener starts and stops with the guard
    return app


async def _start(app: web.Application) -> None:
    state = app[STATE]
    config = state.config
    tracing.setup()  # only with OTEL_EXPORTER_OTLP_ENDPOINT set; in each process (after any fork)
    state.pool.start()
    # Far above anything the admission gate lets through, so the connector never becomes a second queue.
    connector = aiohttp.TCPConnector(limit=4096, limit_per_host=0, enable_cleanup_closed=True)
    # No cookie jar: cookies an engine sets must never be stored and sent with another tenant's request
    # (and a jar costs a lookup per request).
    session = aiohttp.ClientSession(connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar())
    relay = Relay(UpstreamClient(config.upstream.connect_timeout), config.upstream)
    clients = app[CLIENTS] = Clients(session, relay,
                                      TokenCounter(session, state.pool.url, config.upstream.connect_timeout))
    stale_s = config.admission.telemetry_stale_s
    for replica in state.pool:
        subscriber = TelemetrySubscriber(session, replica.url, *_telemetry_callbacks(state, clients, replica), stale_s)
        clients.tasks.append(asyncio.create_task(subscriber.run(), name=f"telemetry {replica.name}"))
        if state.profile.needs_hashes and len(state.pool) > 1:  # a pool of one has nowhere else to route
            events = KVEventSubscriber(session, replica.url, replica.index, stale_s)
            clients.tasks.append(asyncio.create_task(events.run(), name=f"kv events {replica.name}"))
    clients.tasks.append(asyncio.create_task(monitor(state, session), name="monitor"))
    clients.tasks.append(asyncio.create_task(watch_silence(state, relay), name="silence watch"))
    clients.tasks.append(asyncio.create_task(publish_autoscaling(state), name="autoscaling signals"))
    if (shared := state.shared) is not None:
        await shared.resync()  # join the other guards before the first request (alone if Redis is down)
        for work, name in ((shared.run(), "shared state lease"), (shared.deliver(), "shared state wire"),
                           (state.dispatcher.run(), "shared admission"),
                           (share_verdicts(shared, state.escalation), "shared verdicts")):
            clients.tasks.append(asyncio.create_task(work, name=name))


def _telemetry_callbacks(state: GuardState, clients: Clients, replica: Replica):
    metrics = state.metrics

    def on_snapshot(snapshot: TelemetrySnapshot) -> None:
        clients.counter.on_model(snapshot.model)
        learn_adapters(clients.counter, snapshot)
        hits, queries = replica.on_snapshot(snapshot)
        if queries:
            metrics.child(metrics.prefix_reported_hits, replica.name).inc(hits)
            metrics.child(metrics.prefix_reported_queries, replica.name).inc(queries)
        state.detector.on_telemetry(snapshot)
        state.dispatcher.pump()
        state.update_mode()

    def on_busy(progress: StepProgress) -> None:  # alive in a long step: liveness, not new numbers
        replica.gate.busy(progress.step, progress.step_running_s)
        state.update_mode()

    def on_failure() -> None:  # the telemetry stream cannot reach the replica: count it against its breaker
        replica.heard.set()
        replica.breaker.record_failure()
        state.update_mode()

    return on_snapshot, on_busy, on_failure


async def _shutdown(app: web.Application) -> None:
    """The listener is already closed. Queued requests, and any that would queue from now on, get 503 now;
    running ones get ``shutdown_timeout`` to finish. Then every upstream connection is dropped, so that each
    stream still open ends with an error event (and each unary request with a 503) before aiohttp, after
    waiting as long again, would cancel the handlers and cut the streams short."""
    state, clients = app[STATE], app[CLIENTS]
    state.dispatcher.reject_all(GuardError(503, SHUTTING_DOWN, code="shutting_down", retry_after=1))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.config.limits.shutdown_timeout
    while state.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if state.in_flight:
        log.warning("shutdown: %d requests still running after %g s; ending them", state.in_flight,
                    state.config.limits.shutdown_timeout)
        clients.relay.close_all()


async def _cleanup(app: web.Application) -> None:
    clients, dispatcher = app[CLIENTS], app[STATE].dispatcher
    if (shared := app[STATE].shared) is not None:
        shared.stop()  # its loops end on their own, whatever a Redis call does with a cancellation
        dispatcher.stop()
    for task in clients.tasks:
        task.cancel()
    await asyncio.gather(*clients.tasks, return_exceptions=True)
    await clients.session.close()
    clients.relay.client.close()
    if (shared := app[STATE].shared) is not None:
        await shared.close()
    if (decisions := app[STATE].decision_log) is not None:
        await asyncio.to_thread(decisions.close)  # what is still queued is written first
    # The exporter's last batch goes out on its own thread: a collector that is slow to answer must not
    # stall the event loop (nothing else runs on it any more, but the loop's shutdown waits for this).
    await asyncio.to_thread(tracing.shutdown)
