"""The client listener's own handlers beside the completion pipeline: the stamping middleware, the model
list, health and metrics."""

from __future__ import annotations

import random
import re

import aiohttp
import yarl
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from guard.errors import GuardError
from guard.http.clients import CLIENTS
from guard.http.models import visible_models
from guard.http.pipeline import authenticate
from guard.instance import STATE
from guard.wire.connections import GuardedConnection, request_began
from guard.wire.errors import error_response
from guard.wire.stamp import REQUEST_ID, stamp

SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id_of(request: web.Request) -> str:
    """The client's own ``X-Request-Id`` when it is a sane token (1-128 of letters, digits and ``._:-``),
    else a new one: it names the request in logs, traces and its decision record, so it must be printable
    and short. Two requests that share a client's id share it there too; the newer record replaces the older."""
    given = request.headers.get("X-Request-Id")
    if given is not None and SANE_REQUEST_ID.fullmatch(given):
        return given
    # 64 random bits name a request uniquely enough; the ids are no secret (the admin listener shows them), so
    # Python's own generator (reseeded in each forked worker) will do: os.urandom is a system call per request.
    return f"req-{random.getrandbits(64):016x}"


@web.middleware
async def identify(request: web.Request, handler) -> web.StreamResponse:
    """The app's middleware: ``answered``, with the client connection found from the request's transport."""
    return await answered(handler, request, request_began(request))


async def answered(handler, request: web.Request, connection: GuardedConnection | None) -> web.StreamResponse:
    """``handler``'s answer to ``request`` as every request gets it, through aiohttp (``identify``) or the
    front (guard/wire/front.py): its request id set, counted in flight, an HTTP exception answered as an
    error, ``connection`` (whose ``request_began`` the caller has told) told when it ends, and an answer not
    yet sent stamped with the request id and the tenant."""
    request[REQUEST_ID] = request_id_of(request)
    state = request.app[STATE]
    state.in_flight += 1
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        response = error_response(exc.status, exc.reason)
    finally:
        state.in_flight -= 1
        if connection is not None:
            connection.request_ended()
    if not response.prepared:
        stamp(request, response)
    return response


async def models(request: web.Request) -> web.StreamResponse:
    """``GET /v1/models`` and ``GET /v1/models/{id}``: authenticated, then a replica's own answer (its 404
    ``model_not_found`` for an id it does not serve included); every replica serves the same model. A tenant
    with ``models`` sees only those (guard/http/models.py)."""
    state = request.app[STATE]
    try:
        tenant = authenticate(request)
    except GuardError as exc:
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code)
    timeout = aiohttp.ClientTimeout(total=state.config.upstream.connect_timeout * 2)
    # The raw path, so that an id's escapes (a slash as %2F) reach the engine as the client sent them.
    url = state.pool.url() + request.raw_path.split("?", 1)[0]
    try:
        async with request.app[CLIENTS].session.get(yarl.URL(url, encoded=True), timeout=timeout) as r:
            status, body = visible_models(tenant, request.path, r.status, await r.read(), state.pool)
            return web.Response(body=body, status=status, content_type="application/json")
    except (aiohttp.ClientError, TimeoutError):
        return error_response(503, "no engine replica is available", code="engine_unavailable", retry_after=1)


async def health(request: web.Request) -> web.Response:
    """200 whenever the guard can answer (in any mode: degraded still serves fallbacks); the body says how.
    503 ``{"status": "draining"}`` once told to stop (SIGTERM): it still serves what it is sent for
    ``--drain-delay`` seconds, while a load balancer's health check takes it out (guard/__main__.py)."""
    state = request.app[STATE]
    replicas = {r.name: {"up": r.up(), "telemetry_age_s": round(min(r.gate.telemetry_age(), 1e9), 3)}
                for r in state.pool}
    return web.json_response({"status": "draining" if state.draining else "ok", "mode": state.modes.mode,
                              "pool_up": state.pool.any_up(), "replicas": replicas},
                             status=503 if state.draining else 200)


async def metrics_endpoint(request: web.Request) -> web.Response:
    state = request.app[STATE]
    m, pool = state.metrics, state.pool
    for gauge in (m.queue_depth, m.reserved_blocks, m.borrowed_blocks, m.guaranteed_blocks):
        gauge.clear()  # a tenant a reload removed leaves no series behind once its queue has gone
    for name, queue in state.dispatcher.fair.tenants.items():
        m.queue_depth.labels(name).set(len(queue))
        reserved = pool.tenant_reserved(name)
        m.reserved_blocks.labels(name).set(reserved)
        m.borrowed_blocks.labels(name).set(reserved - pool.tenant_guaranteed(name))
    for tenant in state.config.tenants:
        m.guaranteed_blocks.labels(tenant.name).set(state.dispatcher.guarantee(tenant))
    m.budget_blocks.set(pool.budget())
    m.jain.set(state.dispatcher.fair.jain_index())
    for replica in pool:
        gate = replica.gate
        m.telemetry_age.labels(replica.name).set(min(gate.telemetry_age(), 1e9))
        m.backend_reserved.labels(replica.name).set(gate.reserved)
        m.backend_budget.labels(replica.name).set(gate.budget)
        m.backend_used.labels(replica.name).set(gate.snapshot.used_blocks if gate.snapshot is not None else 0)
    return web.Response(body=generate_latest(m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
