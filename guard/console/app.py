"""The admin listener: the live operator console and its state endpoints, served by the guard's own process
and event loop as a second aiohttp site next to the client listener.

Routes:
- ``GET /``: the console page (static/console.html, its stylesheet and script: no CDN, nothing fetched from
  elsewhere);
- ``GET /state``: one snapshot as JSON (guard/console/snapshot.py);
- ``GET /state/stream``: Server-Sent Events, a snapshot about once a second, each carrying the feed's events
  that the stream has not sent yet;
- ``GET /events``: the feed's ring buffer as JSON;
- ``GET /requests?limit=N``: the newest requests' decision records, summed up, newest first (50 by default);
- ``GET /requests/{request_id}``: one request's whole decision record (guard/records/), 404 when unknown.

Access: with ``admin.api_keys`` every request must present one, as ``Authorization: Bearer <key>`` or as
the password of HTTP Basic (what a browser sends after its login prompt, on the page's stream too, since an
``EventSource`` cannot set headers). Without keys the listener is on loopback (the config refuses anything
else) and answers only requests whose ``Host`` is a loopback name, so a web page cannot read it through DNS
rebinding.

Lifecycle: ``install(app)`` hooks the console into the guard app: its site starts when the guard app starts
(a port that cannot be bound stops the guard from starting) and closes, streams ended first, on clean-up.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from guard.batch.install import RUNNER as BATCH_RUNNER
from guard.config import Admin, is_loopback
from guard.console.snapshot import build
from guard.instance import STATE, GuardState

log = logging.getLogger("guard.console")

STATIC = Path(__file__).parent / "static"
ASSETS = {"/": ("console.html", "text/html"), "/console.css": ("console.css", "text/css"),
          "/console.js": ("console.js", "text/javascript")}
STREAM_INTERVAL_S = 1.0
RETRY_MS = 2000  # how soon a browser's EventSource reconnects to a guard that restarted
REALM = 'Basic realm="kvguard console", charset="UTF-8"'
# Nothing of the page may come from elsewhere, and it may not be framed.
SECURITY_HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
                    "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
                    "Cache-Control": "no-store"}


@dataclass(slots=True)
class Console:
    """The running admin site; ``url`` once it listens (its port chosen by the OS when configured as 0)."""

    settings: Admin
    runner: web.AppRunner | None = None
    url: str = ""
    closing: asyncio.Event = field(default_factory=asyncio.Event)  # set: every stream ends


CONSOLE = web.AppKey("console", Console)


def presented_key(request: web.Request) -> str | None:
    """The key a request presents: a Bearer token, or an HTTP Basic password (any user name)."""
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return credentials.strip()
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(credentials.strip(), validate=True).decode().partition(":")[2]
        except (binascii.Error, UnicodeDecodeError):
            return None
    return None


def authorizer(settings: Admin) -> Callable[[web.Request], web.Response | None]:
    """A check that returns the refusal for a request that may not see the console, None for one that may."""
    digests = [hashlib.sha256(key.encode()).digest() for key in settings.api_keys]

    def check(request: web.Request) -> web.Response | None:
        if not digests:
            host = request.url.host or ""
            if is_loopback(host.strip("[]")):
                return None
            return web.json_response({"error": "the console answers loopback host names only"}, status=403)
        key = presented_key(request)
        # Compared as digests, against every key: the time taken says nothing about which one came close.
        given = hashlib.sha256((key or "").encode()).digest()
        if key and sum(hmac.compare_digest(given, digest) for digest in digests):
            return None
        return web.json_response({"error": "the console needs an admin key (admin.api_keys)"}, status=401,
                                 headers={"WWW-Authenticate": REALM})

    return check


def create_console_app(state: GuardState, settings: Admin, closing: asyncio.Event,
                       batches: Callable[[], list[dict[str, Any]]] = list) -> web.Application:
    """The admin listener's app; ``batches`` lists the batches the guard runs now (none without a Batch API)."""
    check = authorizer(settings)

    @web.middleware
    async def guarded(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        refusal = check(request)
        response = refusal if refusal is not None else await handler(request)
        if not response.prepared:
            response.headers.update(SECURITY_HEADERS)
        return response

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", **SECURITY_HEADERS})
        await response.prepare(request)
        sent = 0  # the newest event this stream has sent
        try:
            await response.write(f"retry: {RETRY_MS}\n\n".encode())
            while not closing.is_set():
                snapshot = build(state, sent, batches())
                sent = snapshot["guard"]["event_seq"]
                await response.write(f"data: {json.dumps(snapshot, separators=(',', ':'))}\n\n".encode())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(closing.wait(), STREAM_INTERVAL_S)
        except ConnectionResetError:  # the console was closed: nothing to finish
            pass
        return response

    async def asset(request: web.Request) -> web.Response:
        name, content_type = ASSETS[request.path]
        # Read per request (a small file, rarely asked): edits show on reload, and nothing is held meanwhile.
        return web.Response(body=(STATIC / name).read_bytes(), content_type=content_type, charset="utf-8")

    async def snapshot(request: web.Request) -> web.Response:
        return _json(build(state, batches=batches()))

    async def events(request: web.Request) -> web.Response:
        return _json({"events": state.events.since(0)})

    app = web.Application(middlewares=[guarded])
    for path in ASSETS:
        app.router.add_get(path, asset)
    app.router.add_get("/state", snapshot)
    app.router.add_get("/state/stream", stream)
    app.router.add_get("/events", events)
    add_record_routes(app, state)
    return app


def add_record_routes(app: web.Application, state: GuardState) -> None:
    """``GET /requests`` and ``GET /requests/{request_id}``: the decision records (guard/records/)."""

    async def record(request: web.Request) -> web.Response:
        found = state.records.get(request.match_info["request_id"])
        if found is None:
            message = f"no record of that request: unknown, or older than the last {state.records.capacity:,}"
            return web.json_response({"error": {"message": message, "type": "not_found_error",
                                                "code": "record_not_found"}}, status=404)
        return _json(found.to_dict())

    async def recent(request: web.Request) -> web.Response:
        try:
            limit = min(int(request.query.get("limit", "50")), len(state.records))
        except ValueError:
            return web.json_response({"error": {"message": "limit must be an integer", "type": "invalid_request_error",
                                                "param": "limit"}}, status=400)
        return _json({"requests": [r.summary() for r in state.records.recent(limit)]})

    app.router.add_get("/requests", recent)
    app.router.add_get("/requests/{request_id}", record)


def _json(body: dict[str, Any]) -> web.Response:
    return web.json_response(body, dumps=lambda value: json.dumps(value, separators=(",", ":")))


def install(app: web.Application, settings: Admin) -> None:
    """Serve the console beside the guard ``app`` while it runs (``app[CONSOLE]`` says where)."""
    console = app[CONSOLE] = Console(settings)

    async def start(app: web.Application) -> None:
        console.closing = asyncio.Event()  # on the running loop
        def batches() -> list[dict[str, Any]]:
            return app[BATCH_RUNNER][0].table() if app.get(BATCH_RUNNER) else []

        runner = web.AppRunner(create_console_app(app[STATE], settings, console.closing, batches), access_log=None,
                               shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, settings.host, settings.port)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            where = f"{settings.host}:{settings.port}"
            raise OSError(exc.errno, f"admin listener {where} (admin.host, admin.port): {exc.strerror}") from exc
        console.runner = runner
        port = runner.addresses[0][1]
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        console.url = f"http://{host}:{port}"
        log.info("operator console on %s/", console.url)

    async def stop(app: web.Application) -> None:
        console.closing.set()
        if console.runner is not None:
            await console.runner.cleanup()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
