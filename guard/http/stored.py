"""``GET`` and ``DELETE /v1/responses/{id}`` through the guard: authenticated, then asked of the replicas as the
key's tenant (guard/http/responses.py ``ask_replicas``), so a tenant reads and deletes only its own stored
responses: another tenant's id is a 404, as an unknown one is. They read or drop a record and generate
nothing, so they take no admission in KV blocks, but count against the tenant's ``rpm`` as any request
does; the engine's answer (its 404 included) is relayed as it came.
"""

from __future__ import annotations

import json

from aiohttp import web

from guard.errors import GuardError
from guard.http.clients import CLIENTS
from guard.http.pipeline import authenticate
from guard.http.responses import ask_replicas
from guard.instance import STATE
from guard.wire.errors import error_response


async def stored(request: web.Request) -> web.StreamResponse:
    """``GET`` or ``DELETE /v1/responses/{id}``, as the authenticated tenant, counted against its ``rpm`` (a
    request of no tokens)."""
    state = request.app[STATE]
    try:
        tenant = authenticate(request)
        charge = await state.limiter.charge(tenant, 0)
    except GuardError as exc:
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code, retry_after=exc.retry_after,
                              headers=exc.headers)
    try:
        status, answer = await ask_replicas(state, request.app[CLIENTS], request.method, request.match_info["id"],
                                            tenant.name)
    finally:
        if charge is not None:
            charge.settle(0)
    headers = charge.headers() if charge is not None else {}
    if status == 503:
        return error_response(503, "no engine replica is available", code="engine_unavailable", retry_after=1,
                              headers=headers)
    return web.Response(text=json.dumps(answer), status=status, content_type="application/json", headers=headers)
