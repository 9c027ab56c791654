"""What every answer carries, whoever served it (aiohttp's handlers or the front): the request's id and, once
authenticated, its tenant. The keys are set by the handlers (guard/http/routes.py); the wire only reads them."""

from __future__ import annotations

from aiohttp import web

REQUEST_ID = web.RequestKey("request_id", str)
TENANT = web.RequestKey("tenant", str)


def stamp(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer, errors included, names the request id and the tenant (once known). An answer made with
    them (a relayed one: guard/http/exchange.py ``stamp_headers``) is left as it is."""
    headers = response.headers
    if "X-Request-Id" in headers:
        return
    headers["X-Request-Id"] = request[REQUEST_ID]
    if TENANT in request:
        headers["X-Guard-Tenant"] = request[TENANT]
