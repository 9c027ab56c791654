"""Client connections: deadlines for reading a request, an idle timeout, and a cap on how many are open.

aiohttp accepts every connection and reads a request's headers and body with no deadline of its own, so a
client that dribbles header lines (slowloris) or promises a body it never sends holds a connection, and a
descriptor, for as long as it likes. ``ConnectionGuard`` bounds both, the way nginx
(``client_header_timeout``, ``client_body_timeout``, ``keepalive_timeout``) and Apache's mod_reqtimeout (a
minimum body rate) do.

Mechanism: the guard's runner (``GuardRunner``) hands its listener a protocol factory that wraps each of
aiohttp's request handlers in a ``GuardedConnection`` (the wrapping-protocol pattern of Twisted's
``policies``): it sees every byte that arrives and owns one timer, and the app's one middleware
(guard/http/routes.py ``identify``, through ``request_began``) tells it where its connection is in the request
cycle. Nothing of aiohttp's is patched or subclassed::

    accept --> HEADERS --(request begins)--> BODY --(body at EOF)--> SERVING --(request ends)--> IDLE
                  ^                                                                                   |
                  +------------------------ first byte of the next request ---------------------------+

    HEADERS  header_timeout_s from accept, or from the next request's first byte; bytes do not extend it
    BODY     no pause between two reads longer than body_timeout_s, and on average body_min_rate bytes/s
             beyond a first body_timeout_s: a slow but honest upload passes, a drip does not
    SERVING  no deadline: a stream runs as long as it runs (the relay's client_stall_timeout watches a
             client that stops reading)
    IDLE     keepalive_timeout_s

A missed deadline closes the connection, with a 408 when nothing of a response has been written yet (never
for IDLE: a client between requests is owed nothing), and counts ``guard_connections_cut_total{reason}``.
Beyond ``max_connections`` a new connection is answered 503 at once, with ``Retry-After``, and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import resource
import signal
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import Any, cast

from aiohttp import web

from engine.protocol import ErrorResponse
from guard.config import Connections
from guard.metrics import GuardMetrics
from guard.wire.front_request import FrontRequest
from guard.wire.stamp import REQUEST_ID, TENANT

log = logging.getLogger("guard.connections")

# Descriptors kept for everything but client connections: listeners, the engines' telemetry and KV-event
# streams, the event loop's own, logs, imported modules.
RESERVED_DESCRIPTORS = 256
# Even where descriptors abound: one event loop serves them all, and the KV budget admits far fewer requests
# than this at once (scale out with more guards instead).
MAX_CONNECTIONS_CEILING = 10_000
# A client that is still sending when the connection closes would get a reset, which discards the answer
# waiting in its receive buffer (the 503 of a refusal, the 408 of a deadline); so the guard half-closes and
# reads (and drops) what still comes for up to this long, then closes.
REFUSAL_LINGER_S = 1.0
MAX_LINGERING_REFUSALS = 256  # past this many at once, a refusal closes at once: its descriptor matters more
CAPACITY_WARNING_INTERVAL_S = 60.0


def default_max_connections(soft_limit: int) -> int:
    """What ``max_connections`` is when not configured: half the descriptors left after the reserve (each
    client connection may hold one to an engine while it is served), at most ``MAX_CONNECTIONS_CEILING``."""
    if soft_limit == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS_CEILING
    return max(1, min(MAX_CONNECTIONS_CEILING, (soft_limit - RESERVED_DESCRIPTORS) // 2))


def raise_descriptor_limit() -> int:
    """Raise this process's soft ``RLIMIT_NOFILE`` to its hard limit, as Go's runtime does at start-up, and
    return it. The usual soft default (1024) protects ``select()``, which asyncio's loops never use; systemd
    leaves raising it to the services that need it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        with contextlib.suppress(ValueError, OSError):  # an unlimited hard limit above the kernel's nr_open
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


def raw_response(status: int, message: str, code: str, headers: Mapping[str, str]) -> bytes:
    """A whole HTTP/1.1 answer in the OpenAI error shape, written straight to a transport and followed by the
    close: for the times no aiohttp response exists to carry it (or none can be trusted to)."""
    body = ErrorResponse.of(status, message, code=code).model_dump_json().encode()
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "Content-Type: application/json",
            f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class Phase(enum.Enum):
    HEADERS = "header_timeout"  # the value: the reason a cut in this phase is counted under
    BODY = "body_timeout"
    SERVING = "serving"
    IDLE = "idle"
    CLOSING = "closing"  # answered and half-closed: what the client still sends is dropped


class ConnectionGuard:
    """One per app (``app[CONNECTIONS]``): the settings, the count of open connections and the cap.

    ``open`` counts ``GuardedConnection``s from ``connection_made`` to ``connection_lost``: the connections
    whose descriptors are the guard's. A burst accepted in one turn of the loop is checked against the count
    before any of it is connected, so the cap may be passed by up to the listen backlog; the descriptors
    reserved below the limit absorb that."""

    def __init__(self, settings: Connections, metrics: GuardMetrics) -> None:
        self.settings = settings
        self.metrics = metrics
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        affordable = default_max_connections(soft)
        self.max_connections = settings.max_connections or affordable
        if self.max_connections > affordable:
            log.warning("connections.max_connections %d exceeds what the descriptor limit (%d) affords; "
                        "holding at most %d", self.max_connections, soft, affordable)
            self.max_connections = affordable
        # The longest a connection's timer waits (see GuardedConnection): the shortest of the deadlines, so
        # that whichever phase comes next, its deadline is never before the timer already pending.
        self.tick = min(settings.header_timeout_s, settings.body_timeout_s, settings.keepalive_timeout_s)
        self.open = 0
        self.lingering = 0  # refusals still draining
        # The client port's protocol, given aiohttp's handler factory (guard/wire/front.py, set by the app);
        # None: aiohttp's handler itself.
        self.front: Callable[[Callable[[], asyncio.Protocol]], asyncio.Protocol] | None = None
        self.connections: set[GuardedConnection] = set()  # open ones, for shutdown
        self.warned_at = -CAPACITY_WARNING_INTERVAL_S
        metrics.connections_open.set_function(lambda: self.open)
        metrics.connections_limit.set(self.max_connections)
        self.refused_answer = raw_response(503, f"the guard holds its limit of {self.max_connections} open "
                                           "connections; retry shortly", "too_many_connections",
                                           {"Retry-After": "1"})
        self.header_timeout_answer = raw_response(408, "the request's headers did not arrive within "
                                                  f"{settings.header_timeout_s:g} s", "request_timeout", {})

    def accept(self, server: Callable[[], asyncio.Protocol]) -> asyncio.Protocol:
        """The listener's protocol factory (``server``: aiohttp's): a guarded request handler (the front's,
        when ``front`` is set) or a refusal."""
        if self.open < self.max_connections:
            return GuardedConnection(self, server() if self.front is None else self.front(server))
        self.cut("over_capacity")
        now = time.monotonic()
        if now - self.warned_at >= CAPACITY_WARNING_INTERVAL_S:
            self.warned_at = now
            log.warning("refusing connections: %d open, connections.max_connections is %d", self.open,
                        self.max_connections)
        return Refusal(self)

    def cut(self, reason: str) -> None:
        self.metrics.child(self.metrics.connections_cut, reason).inc()


class GuardedConnection(asyncio.Protocol):
    """aiohttp's request handler for one connection (``handler``), with its deadlines: every call of the
    transport's is passed on unchanged after the phase has been noted.

    Invariant: from ``connection_made`` until the connection is lost or cut, while the phase has a deadline
    (``deadline``, loop time) a ``timer`` is pending at or before it, and never later than ``guard.tick``
    after it was set. A timer that goes off before the deadline sets the next one. So a phase change only
    moves ``deadline``: the deadline it sets (``tick`` or more from now) is never before the pending timer,
    and a keep-alive request, which changes phase three times, costs no timer at all (a timer per phase
    change was the largest of the guard's own costs per request)."""

    __slots__ = ("body_bytes", "body_start", "deadline", "guard", "handler", "last_read", "loop", "phase",
                 "request", "timer", "transport")

    def __init__(self, guard: ConnectionGuard, handler: asyncio.Protocol) -> None:
        self.guard = guard
        self.handler = handler
        self.transport: asyncio.Transport | None = None
        self.phase = Phase.HEADERS
        self.timer: asyncio.TimerHandle | None = None
        self.deadline: float | None = None  # when the phase's deadline passes (None: the phase has none)
        self.loop = asyncio.get_running_loop()
        self.request: web.BaseRequest | FrontRequest | None = None  # the one being read, while in BODY
        self.body_start = self.last_read = 0.0
        self.body_bytes = 0

    # -- the transport's calls ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.guard.open += 1
        self.guard.connections.add(self)
        self._enter(Phase.HEADERS, self.guard.settings.header_timeout_s)
        self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        phase = self.phase
        if phase is Phase.CLOSING:
            return
        if phase is Phase.BODY:
            self.body_bytes += len(data)
            self.last_read = self.loop.time()
        elif phase is Phase.IDLE:  # the next request begins: its headers are due from now
            self._enter(Phase.HEADERS, self.guard.settings.header_timeout_s)
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        if self.phase is Phase.CLOSING:
            return False  # the client has closed its side too: close ours
        return self.handler.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.open -= 1
        self.guard.connections.discard(self)
        self._stop()
        self.transport = None
        self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()

    # -- the request cycle (``request_began``) -------------------------------------------------------------
    def request_began(self, request: web.BaseRequest | FrontRequest) -> None:
        """Its headers are in; its body (if any) is still to come."""
        if self.transport is None or self.phase is Phase.CLOSING:
            return
        if request.content.is_eof():
            self._enter(Phase.SERVING, None)
            return
        self.request = request
        self.body_start = self.last_read = self.loop.time()
        self.body_bytes = 0
        self._enter(Phase.BODY, self.guard.settings.body_timeout_s)

    def request_ended(self) -> None:
        self.request = None
        if self.transport is not None and self.phase is not Phase.CLOSING:
            self._enter(Phase.IDLE, self.guard.settings.keepalive_timeout_s)

    # -- deadlines ------------------------------------------------------------------------------------------
    def _enter(self, phase: Phase, timeout: float | None) -> None:
        self.phase = phase
        if timeout is None:
            self.deadline = None  # a pending timer goes off to find nothing due
            return
        now = self.loop.time()
        self.deadline = now + timeout
        if self.timer is None:
            self._arm(now)

    def _arm(self, now: float) -> None:
        """A timer at the deadline, or at ``guard.tick`` from now if that is sooner."""
        assert self.deadline is not None
        self.timer = self.loop.call_at(min(self.deadline, now + self.guard.tick), self._expire)

    def _stop(self) -> None:
        self.deadline = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _body_deadline(self) -> float:
        """The later the more has arrived, but never more than ``body_timeout_s`` after the last read."""
        settings = self.guard.settings
        earned = self.body_start + settings.body_timeout_s + self.body_bytes / settings.body_min_rate
        return min(self.last_read + settings.body_timeout_s, earned)

    def _expire(self) -> None:
        self.timer = None
        transport, deadline = self.transport, self.deadline
        if transport is None or deadline is None:
            return
        if (now := self.loop.time()) < deadline:  # set before the deadline moved (or went off a bit early)
            self._arm(now)
            return
        answer: bytes | None = None
        if self.phase is Phase.HEADERS:
            # Unless the previous answer is still leaving (a pipelined request waits for it to be sent)
            if not transport.get_write_buffer_size():
                answer = self.guard.header_timeout_answer
        elif self.phase is Phase.BODY:
            request = self.request  # set on entering BODY
            if request is None or request.content.is_eof():  # the body is in: being served, no deadline
                self.request, self.deadline = None, None
                self.phase = Phase.SERVING
                return
            self.deadline = self._body_deadline()
            if self.deadline > now:  # bytes arrived since the deadline was set
                self._arm(now)
                return
            if _nothing_written(request):  # nothing of an answer on the wire: a 408 is the answer
                answer = raw_response(408, "the request body stopped arriving (connections.body_timeout_s "
                                      f"{self.guard.settings.body_timeout_s:g} s, body_min_rate "
                                      f"{self.guard.settings.body_min_rate:g} bytes/s)", "request_timeout",
                                      {"X-Request-Id": request.get(REQUEST_ID, ""),
                                       **({"X-Guard-Tenant": request[TENANT]} if TENANT in request else {})})
        log.debug("closing a connection: %s", self.phase.value)
        self.guard.cut(self.phase.value)
        if answer is None or not transport.can_write_eof():
            transport.close()  # the handler, if one runs, is cancelled when the connection is lost
            return
        transport.write(answer)
        transport.write_eof()
        self.phase, self.deadline = Phase.CLOSING, None
        self.timer = self.loop.call_later(REFUSAL_LINGER_S, transport.close)


def _nothing_written(request: web.BaseRequest | FrontRequest) -> bool:
    return request.written == 0 if isinstance(request, FrontRequest) else request.writer.output_size == 0


class Refusal(asyncio.Protocol):
    """A connection over the cap: answered 503 at once, then half-closed; what the client still sends is
    dropped until it closes too, or ``REFUSAL_LINGER_S`` passes (no time at all past
    ``MAX_LINGERING_REFUSALS`` of them)."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        self.guard.lingering += 1
        transport.write(self.guard.refused_answer)
        if transport.can_write_eof():
            transport.write_eof()
        linger = REFUSAL_LINGER_S if self.guard.lingering <= MAX_LINGERING_REFUSALS else 0.0
        self.timer = asyncio.get_running_loop().call_later(linger, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the client has closed its side: close ours

    def connection_lost(self, exc: Exception | None) -> None:
        self.guard.lingering -= 1
        if self.timer is not None:
            self.timer.cancel()


CONNECTIONS = web.AppKey("connections", ConnectionGuard)


def request_began(request: web.Request) -> GuardedConnection | None:
    """Tell the request's ``GuardedConnection`` that the request began, and return it, to be told
    ``request_ended`` once the answer is done (None when the app is served by a runner other than
    ``GuardRunner``). The middleware calls it: a middleware of its own would cost a coroutine per request."""
    transport = request.transport
    connection = transport.get_protocol() if transport is not None else None
    if not isinstance(connection, GuardedConnection):
        return None
    connection.request_began(request)
    return connection


class GuardRunner(web.AppRunner):
    """``web.AppRunner`` for an app of ``create_app``: its sites accept through its ``ConnectionGuard``."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        settings = app[CONNECTIONS].settings
        # aiohttp's own keep-alive timer stays, as a backstop that goes off after every deadline of ours
        # (which count what they close) would have.
        kwargs.setdefault("keepalive_timeout", settings.keepalive_timeout_s + settings.header_timeout_s)
        self.shutdown_timeout: float = kwargs.get("shutdown_timeout", 60.0)
        super().__init__(app, **kwargs)

    async def shutdown(self) -> None:
        """After aiohttp's ``pre_shutdown`` closed its idle connections: the front's idle ones close too, its
        busy ones after their answer; the app's shutdown (which lets running requests finish) runs; then
        what still runs on a front connection gets ``shutdown_timeout`` as aiohttp's handlers do."""
        handlers = [connection.handler for connection in self.app[CONNECTIONS].connections]
        fronts = [handler for handler in handlers if hasattr(handler, "close_idle")]  # guard/wire/front.py's
        for front in fronts:
            front.close_idle()
        await super().shutdown()
        await asyncio.gather(*(front.shutdown(self.shutdown_timeout) for front in fronts))

    @property
    def server(self) -> Any:
        """What the sites accept connections with: aiohttp's server behind ``ConnectionGuard.accept``."""
        server = super().server
        return None if server is None else functools.partial(self.app[CONNECTIONS].accept, server)


def serve(app: web.Application, host: str, port: int, *, shutdown_timeout: float,
          reuse_port: bool = False, loop: asyncio.AbstractEventLoop | None = None, drain_delay: float = 0.0,
          on_drain: Callable[[], None] | None = None) -> None:
    """Serve ``app`` (from ``create_app``) on ``host:port`` until SIGINT or SIGTERM, then shut down
    gracefully: ``web.run_app``, which cannot be given a runner, with a ``GuardRunner``. As there, only the
    serving task is cancelled at first, so that its clean-up gives running requests ``shutdown_timeout``.
    ``reuse_port``: bind with ``SO_REUSEPORT``, so that the workers of ``--workers N`` (guard/__main__.py)
    share the port and the kernel spreads new connections among them. ``loop``: a new loop to run on
    (guard/__main__.py picks uvloop's), by default the standard library's.

    SIGTERM drains: ``on_drain()`` is called at once (the app's /health turns 503), the listener keeps
    accepting and serving for ``drain_delay`` seconds, so that a load balancer's health check moves new
    requests elsewhere before the port closes, and then the shutdown above runs. SIGINT, or a second
    SIGTERM, closes the listener at once, as SIGTERM does with ``drain_delay`` 0."""
    loop = loop or asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    main = loop.create_task(_serve(app, host, port, shutdown_timeout, reuse_port, drain_delay, on_drain))
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        if not main.done():
            main.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(main)
        rest = asyncio.all_tasks(loop)
        for task in rest:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def _serve(app: web.Application, host: str, port: int, shutdown_timeout: float, reuse_port: bool,
                 drain_delay: float, on_drain: Callable[[], None] | None) -> None:
    runner = GuardRunner(app, handle_signals=True, handler_cancellation=True,
                         shutdown_timeout=shutdown_timeout)
    await runner.setup()  # SIGINT (and SIGTERM, replaced below) raise GracefulExit from here on
    try:
        await web.TCPSite(runner, host, port, reuse_port=reuse_port or None).start()
        await _until_drained(drain_delay, on_drain)
    finally:
        await runner.cleanup()


async def _until_drained(delay: float, on_drain: Callable[[], None] | None) -> None:
    """Return ``delay`` seconds after the first SIGTERM (at once on a second one); SIGINT raises GracefulExit
    (aiohttp's handler) meanwhile."""
    loop, stop, draining = asyncio.get_running_loop(), asyncio.Event(), False

    def sigterm() -> None:
        nonlocal draining
        if draining:  # a second SIGTERM: no more waiting
            stop.set()
            return
        draining = True
        loop.call_later(delay, stop.set)
        if on_drain is not None:
            on_drain()
        log.warning("draining: /health answers 503; the listener closes in %g s", delay)

    loop.add_signal_handler(signal.SIGTERM, sigterm)
    await stop.wait()
