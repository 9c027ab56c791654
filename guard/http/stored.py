"""``GET`` and ``DELETE /v1/responses/{id}`` through the guard: authenticated, then asked of the replicas as the
key's tenant (guard/http/responses.py ``ask_replicas``), so a tenant reads and deletes only its own stored
responses: another tenant's id is a 404, as an unknown one is. They read or drop a record and generate
nothing, so they take no admission; the engine's answer (its 404 included) is relayed as it came.
"""

from __future__ import annotations

import json

from aiohttp import web

from guard.errors import GuardError
from guard.http.context import CLIENTS, STATE
from guard.http.errors import error_response
from guard.http.pipeline import authenticate
from guard.http.responses import ask_replicas


async def stored(request: web.Request) -> web.StreamResponse:
    """``GET`` or ``DELETE /v1/responses/{id}``, as the authenticated tenant."""
    try:
        tenant = authenticate(request)
    except GuardError as exc:
        return error_response(exc.status, exc.message, code=exc.code)
    status, answer = await ask_replicas(request.app[STATE], request.app[CLIENTS], request.method,
                                         request.match_info["id"], tenant.name)
    if status == 503:
        return error_response(503, "no engine replica is available", code="engine_unavailable", retry_after=1)
    return web.Response(text=json.dumps(answer), status=status, content_type="application/json")
