"""The guard's front: the client port's protocol, which serves the completion routes itself and hands every
other request to aiohttp.

aiohttp's server turns each request into a ``web.Request``, a payload stream, a task, a router match, a
middleware chain and a ``web.Response`` prepared through its writer: about a third of the guard's CPU per
request. ``FrontConnection`` parses with httptools (llhttp, as aiohttp's own C parser) and serves
``POST /v1/completions``, ``/v1/chat/completions`` and ``/v1/responses`` over HTTP/1.1 by calling the same
pipeline (guard/http/pipeline.py ``completion``) with a ``FrontRequest`` (guard/wire/front_request.py), and
writes its answer in one call. What ``identify`` (the app's middleware) does for aiohttp's requests it does
here: the request id, the in-flight count, the stamped headers, the connection's phases.

Anything else (another route or method, HTTP/1.0, an upgrade, an ``Expect`` other than ``100-continue``,
bytes that do not parse) goes to aiohttp's own request handler, which from then on serves the connection:

- the connection's first request: every byte so far is handed over as it came;
- a later one: once the requests before it are answered, it is handed over re-framed from what the parser
  read (the same request line, headers and body; a chunked body chunked again), and so is whatever follows
  until the parser stands at a message boundary at the end of what arrived; from then on bytes pass as
  they come.

Invariants: a connection's requests are answered one at a time, in order (a pipelined request waits, and
reading pauses while one does), by one task a connection; that task is cancelled when its connection is
lost (as aiohttp's ``handler_cancellation``), so a client that leaves gives its reservation back; a
request whose body was not read whole by the time it is answered ends the connection after the answer.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
from aiohttp import web
from multidict import CIMultiDict

from guard.wire.connections import REFUSAL_LINGER_S, GuardedConnection, raw_response
from guard.wire.errors import error_response
from guard.wire.front_request import CHUNKED_EOF, Flow, FrontRequest, FrontStream, head
from guard.wire.stamp import stamp

ROUTES = frozenset(("/v1/completions", "/v1/chat/completions", "/v1/responses"))
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
MAX_FIELD, MAX_HEADERS = 8190, 128  # aiohttp's server defaults (max_field_size, max_headers)
BODY_SLACK = 1024  # past max_body_bytes, as the app's client_max_size

log = logging.getLogger("guard.front")
ACCESS = logging.getLogger("aiohttp.access")  # the front's requests are logged where aiohttp logs the others

# A request's answer: called with the request and the guarded connection it came on (None: not guarded),
# which it tells when the request ends.
Handler = Callable[[FrontRequest, GuardedConnection | None], Awaitable[Any]]


class FrontConnection(asyncio.Protocol):
    """One client connection (see the module). ``handler`` answers the front's requests; ``max_body_bytes``
    is the app's body limit; ``server``: aiohttp's request-handler factory, called once the connection is
    handed over."""

    def __init__(self, app: web.Application, handler: Handler, max_body_bytes: int,
                 server: Callable[[], asyncio.Protocol]) -> None:
        self.app = app
        self.handler = handler
        self.server = server
        # Body bytes kept at most, as aiohttp's client_max_size (guard/server/app.py): the handler's 413
        # comes first, this only bounds what a connection can make the guard hold.
        self.limit = max_body_bytes + BODY_SLACK
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.flow = Flow()
        self.url: list[bytes] = []  # the request line's target, as parsed so far
        self.headers: CIMultiDict[str] = CIMultiDict()  # the headers of the request being parsed
        self.reading: FrontRequest | None = None  # the request whose body is being parsed
        self.queue: collections.deque[FrontRequest] = collections.deque()  # the first is being served
        # One task serves the connection's requests in turn (``_serve_all``), not one a request: a task costs
        # its creation and a place in asyncio's registry of tasks, ~1 us a request.
        self.task: asyncio.Task[None] | None = None
        self.busy = False  # a request is being served
        self.idle: asyncio.Future[None] | None = None  # what the task waits on between requests
        self.prefix: bytes | None = b""  # every byte so far, until a first request is the front's
        self.handoff: bytearray | None = None  # re-framed bytes for aiohttp, once a request is its
        self.chunked = False  # the request being handed over has a chunked body
        self.aiohttp: asyncio.Protocol | None = None  # aiohttp's handler, once handed over
        self.guarded: GuardedConnection | None = None
        self.passthrough = False  # bytes go to aiohttp as they come
        self.in_message = False
        self.closing = False
        self.broken = b""  # the answer to bytes that did not parse, once what came before is answered

    # -- the transport's calls ------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        guarded = transport.get_protocol()  # the deadlines' wrapper around this (guard/wire/connections.py)
        self.guarded = guarded if isinstance(guarded, GuardedConnection) else None

    def data_received(self, data: bytes) -> None:
        if self.passthrough:
            if self.aiohttp is not None:
                self.aiohttp.data_received(data)
            else:  # still answering the requests before the one handed over
                assert self.handoff is not None
                self.handoff += data
            return
        if self.closing:
            return
        if self.prefix is not None:
            self.prefix += data
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._hand_over_rest(data[exc.args[0]:] if exc.args else b"")
        except httptools.HttpParserError as exc:
            self._malformed(exc)
        if self.handoff is not None:
            if self.prefix is not None:  # the front took no request on this connection: every byte as it came
                self.handoff, self.prefix, self.passthrough = bytearray(self.prefix), None, True
            elif not self.in_message:  # re-framed up to a message boundary that ends these bytes
                self.passthrough = True
        self._next()

    def eof_received(self) -> bool | None:
        if self.aiohttp is not None:
            return self.aiohttp.eof_received()
        return None  # the client closed its side: the transport closes (and cancels what runs), as aiohttp's

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.flow.lost = True
        self.flow.wake(ConnectionResetError("the client connection is closed"))
        for request in self.queue:
            request.lost()
        if self.task is not None:
            self.task.cancel()
        if self.aiohttp is not None:
            self.aiohttp.connection_lost(exc)

    def pause_writing(self) -> None:
        self.flow.paused = True
        if self.aiohttp is not None:
            self.aiohttp.pause_writing()

    def resume_writing(self) -> None:
        self.flow.paused = False
        self.flow.wake()
        if self.aiohttp is not None:
            self.aiohttp.resume_writing()

    # -- the parser's calls ---------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.url, self.headers, self.in_message = [], CIMultiDict(), True

    def on_url(self, url: bytes) -> None:
        self.url.append(url)
        if sum(map(len, self.url)) > MAX_FIELD:
            raise ValueError(f"a request target over {MAX_FIELD} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        # aiohttp's limits: a request past them is refused by its parser (the first one of a connection is
        # handed to aiohttp, so its own 400 answers it), never held in memory.
        if len(name) > MAX_FIELD or len(value) > MAX_FIELD or len(self.headers) >= MAX_HEADERS:
            raise ValueError(f"a header over {MAX_FIELD} bytes, or more than {MAX_HEADERS} headers")
        # As aiohttp's parser decodes them; both decodings give back the very bytes (``_reframe_head``).
        self.headers.add(name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))

    def on_headers_complete(self) -> None:
        parser, headers = self.parser, self.headers
        url = (self.url[0] if len(self.url) == 1 else b"".join(self.url)).decode("utf-8", "surrogateescape")
        expect = headers.get("Expect")
        if (self.handoff is None and parser.get_method() == b"POST" and url.split("?", 1)[0] in ROUTES
                and parser.get_http_version() == "1.1" and not parser.should_upgrade()
                and (expect is None or expect.lower() == "100-continue")):
            assert self.transport is not None
            request = FrontRequest(self.app, self.transport, self.flow, "POST", url, headers,
                                   parser.should_keep_alive(), self.limit)
            self.reading = request
            self.queue.append(request)
            self.prefix = None  # the connection is the front's: nothing before this needs handing over
            if len(self.queue) > 1:
                self.transport.pause_reading()  # pipelined: read on once the ones before are answered
            return
        self._reframe_head(url, headers)
        if self.queue and self.transport is not None:
            self.transport.pause_reading()  # until the requests before it are answered

    def on_body(self, body: bytes) -> None:
        if self.reading is not None:
            self.reading.feed(body)
        elif self.handoff is not None:
            self.handoff += b"%x\r\n%b\r\n" % (len(body), body) if self.chunked else body

    def on_message_complete(self) -> None:
        self.in_message = False
        if self.reading is not None:
            self.reading.finish_body()
            self.reading = None
        elif self.handoff is not None and self.chunked:
            self.handoff += CHUNKED_EOF

    # -- handing over to aiohttp ----------------------------------------------------------------------------
    def _reframe_head(self, url: str, headers: CIMultiDict[str]) -> None:
        """The request's head as it came, for aiohttp; its body follows (chunked again if it came chunked)."""
        if self.handoff is None:
            self.handoff = bytearray()
        method = self.parser.get_method()
        self.handoff += b"%b %b HTTP/%b\r\n" % (method, url.encode("utf-8", "surrogateescape"),
                                               self.parser.get_http_version().encode())
        for name, value in headers.items():
            self.handoff += b"%b: %b\r\n" % (name.encode("latin-1"), value.encode("utf-8", "surrogateescape"))
        self.handoff += b"\r\n"
        self.chunked = "chunked" in headers.get("Transfer-Encoding", "").lower()

    def _hand_over_rest(self, rest: bytes) -> None:
        """An upgrade: what follows its head is no HTTP this parser reads; aiohttp gets it as it came."""
        if self.prefix is not None:
            self.handoff = bytearray()  # the prefix holds it all
            return
        if self.handoff is None:
            self.handoff = bytearray()
        self.handoff += rest
        self.in_message, self.passthrough = False, True

    def _malformed(self, exc: Exception) -> None:
        if self.prefix is not None:  # nothing was served: aiohttp answers it as it would have
            self.handoff = bytearray()
            return
        self.closing = True  # answered once the requests before it are
        reason = exc.__cause__ or exc.__context__ or exc  # a limit of on_url's or on_header's, or llhttp's
        self.broken = raw_response(400, f"malformed HTTP request: {reason}", "invalid_request", {})

    def _hand_over(self) -> None:
        assert self.transport is not None and self.handoff is not None
        self.aiohttp = handler = self.server()
        handler.connection_made(self.transport)
        data, self.handoff = bytes(self.handoff), bytearray()
        if data:
            handler.data_received(data)
        self.transport.resume_reading()

    # -- serving --------------------------------------------------------------------------------------------
    def _next(self) -> None:
        """Serve the next request, or hand over, or answer a malformed one, once nothing is being served."""
        if self.busy or self.transport is None:
            return
        if self.queue:
            self.busy = True
            if self.task is None:
                self.task = asyncio.get_running_loop().create_task(self._serve_all())
            else:  # waiting for it, or ending the request before it and then going on with it
                self._wake()
            return
        if self.handoff is not None:
            if self.aiohttp is None:
                self._hand_over()
                self._wake()  # nothing more for the task to serve: it ends
            elif self.handoff:
                self.aiohttp.data_received(bytes(self.handoff))
                self.handoff = bytearray()
        elif self.closing and self.transport is not None:
            self.transport.write(self.broken)
            self.transport.close()
            self._wake()

    def _wake(self) -> None:
        """The task waiting between requests looks again: at a request to serve, or at a connection that
        will have no more."""
        if (idle := self.idle) is not None:
            self.idle = None
            idle.set_result(None)

    async def _serve_all(self) -> None:
        """Serve the queued requests in turn, waiting between them, until the connection can take no more
        (it closes, is handed over, or is lost: then the task is cancelled)."""
        loop = asyncio.get_running_loop()
        while True:
            await self._serve(self.queue[0])
            while not self.busy:
                if self.transport is None or self.closing or self.handoff is not None:
                    self.task = None
                    return
                self.idle = loop.create_future()
                await self.idle

    async def _serve(self, request: FrontRequest) -> None:
        transport, guarded, began = self.transport, self.guarded, time.monotonic()
        if transport is not None and request.headers.get("Expect") is not None:  # 100-continue (the only one)
            transport.write(CONTINUE)
        if guarded is not None:
            guarded.request_began(request)  # type: ignore[arg-type]
        try:
            response: Any = await self.handler(request, guarded)
        except Exception:  # a bug: the client still gets an answer, as aiohttp would give it
            log.exception("error serving %s", request.path)
            response = error_response(500, "internal error in the guard")
            stamp(request, response)  # type: ignore[arg-type]
        try:
            self._answer(request, response)
        except ConnectionError:
            pass  # the client left as its answer was ready
        if ACCESS.isEnabledFor(logging.INFO):
            self._log_access(request, response.status, began)
        self._done(request)

    def _log_access(self, request: FrontRequest, status: int, began: float) -> None:
        """The line aiohttp's access logger writes, in its default format, for a request the front served
        (its size, as aiohttp's, is the whole answer's)."""
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        started = datetime.datetime.now(datetime.UTC).astimezone() - datetime.timedelta(
            seconds=time.monotonic() - began)
        ACCESS.info('%s %s "%s %s HTTP/1.1" %d %d "%s" "%s"', peer[0] if peer else "-",
                    started.strftime("[%d/%b/%Y:%H:%M:%S %z]"), request.method, request.raw_path, status,
                    request.written, request.headers.get("Referer", "-"),
                    request.headers.get("User-Agent", "-"))

    def _answer(self, request: FrontRequest, response: Any) -> None:
        if request.transport is None or request.transport.is_closing():
            return  # the client left: there is nobody to answer
        if isinstance(response, FrontStream):
            if not response.eof_sent:
                request.write(CHUNKED_EOF)
            return
        body = response.body or b""
        keep_alive = request.keep_alive and request.body_done
        framing = f"Content-Length: {len(body)}"
        request.write(head(response.status, response.headers.items(), framing, keep_alive) + body)

    def _done(self, request: FrontRequest) -> None:
        self.busy = False
        if self.queue and self.queue[0] is request:
            self.queue.popleft()
        transport = self.transport
        if transport is None:
            return
        if not request.keep_alive and request.body_done:
            self.closing, self.broken = True, b""
            self.queue.clear()
            transport.close()  # once what is buffered has gone, as aiohttp closes a connection that asked to
            return
        if not request.body_done:
            # Bytes the client still sends would reset the connection and discard the answer it has not
            # read yet: half-close, drop what comes, close a moment later.
            self.closing, self.broken = True, b""
            self.queue.clear()
            if transport.can_write_eof():
                transport.write_eof()
            asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.close)
            return
        transport.resume_reading()
        self._next()

    # -- shutdown (guard/wire/connections.py GuardRunner) ---------------------------------------------------
    def close_idle(self) -> None:
        """Shutdown begins: an idle connection closes now, a busy one after its answer."""
        if self.aiohttp is not None or self.transport is None:
            return
        if not self.busy:
            self.transport.close()
        else:
            for request in self.queue:
                request.keep_alive = False

    async def shutdown(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the request being served, then cancel it."""
        if not self.busy or self.task is None or self.aiohttp is not None:
            return
        task = self.task
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
