"""The guard's HTTP/1.1 client for its one hot call: a request POSTed to an engine and the answer read back.

aiohttp's ``ClientSession`` builds, for every request, a URL object, header multidicts, a payload object,
a request writer, a response with its own stream reader, and walks its connector's pool through several
coroutines: a quarter of the guard's CPU per unary request (py-spy under wrk, bench/guard_ab.py). This
client does what the relay needs and no more: a keep-alive pool per engine, the request written as one
bytes object, the answer parsed by ``httptools`` (llhttp, Node.js's parser, in C; chunked transfer decoded
there) into the fields the relay reads, and the body handed over as it arrives. The guard's other calls
(telemetry, KV events, tokenizer, health) stay on aiohttp: they are not per request.

Invariants:
- a connection carries one request at a time, and goes back to its pool only when its answer was read to
  the end and both sides keep it alive; anything else (an answer closed early, a failure, a revoke)
  closes it, so the engine sees the disconnect and aborts the request;
- an answer buffers at most about ``HIGH_WATER`` bytes: beyond, its socket stops being read until the
  relay drains it, so a slow client costs that much here plus the socket buffers;
- every wait has a deadline: the connect (``ConnectFailed``: nothing was sent), the headers and each read
  of the body (``TimeoutError``).
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse
from typing import Self

import httptools

HIGH_WATER = 64 * 1024


class UpstreamError(Exception):
    """The engine's connection failed, or its answer broke off or was no HTTP."""


class ConnectFailed(UpstreamError):
    """No connection: refused, unreachable, or not accepted within the connect timeout. Nothing was sent."""


class Disconnected(UpstreamError):
    """The connection closed before the answer was complete."""


class Reset(Disconnected):
    """The connection was reset (or broke with an error) before the answer was complete."""


class BadResponse(UpstreamError):
    """What the engine sent is not an HTTP answer."""


class Answer:
    """An engine's answer: ``status`` and ``headers`` (names in lower case) once they came, then the body
    through ``readany``/``read``. Close it (drops the connection) or release it (back to the pool when read
    to the end); ``async with`` releases."""

    __slots__ = ("_chunks", "_connection", "_deadline", "_eof", "_error", "_given_back", "_read_timeout", "_size",
                 "_waiter", "headers", "status")

    def __init__(self, connection: Connection, read_timeout: float) -> None:
        self.status = 0  # until the headers came
        self.headers: dict[str, str] = {}
        self._connection = connection
        # Released or closed: the connection is no longer this answer's (another answer may have it from the
        # pool), so a second release or close must not touch it (releasing twice pooled it twice, and two
        # answers then read one connection's bytes).
        self._given_back = False
        self._chunks: list[bytes] = []
        self._size = 0
        self._eof = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._read_timeout = read_timeout
        # The wait's deadline; the connection's timer goes off no later (``Connection.watch``).
        self._deadline = 0.0

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").partition(";")[0].strip().lower()

    def is_eof(self) -> bool:
        """The body was read to its end."""
        return self._eof and not self._chunks

    async def readany(self) -> bytes:
        """What came since the last read, waiting for it when nothing did; b"" at the end of the body.
        Raises ``TimeoutError`` when nothing comes within the read timeout, or the connection's failure."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._eof:
                return b""
            await self._wait(self._read_timeout)
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks, self._size = [], 0
        self._connection.drained()
        return data

    async def read(self) -> bytes:
        """The whole body."""
        if self._eof and self._error is None:  # it came with the headers, as a small answer does: no wait
            body = b"".join(self._chunks)
            self._chunks, self._size = [], 0
            self._connection.drained()
            return body
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def close(self) -> None:
        """Drop the connection now; a read waiting or to come raises ``Disconnected``. Once is enough: later
        calls (or a release) leave the connection alone."""
        self.fail(Disconnected("closed by the guard"))
        if not self._given_back:
            self._given_back = True
            self._connection.abort()

    def release(self) -> None:
        """Done with the answer: its connection goes back to the pool if the body was read to the end (else it
        is dropped). Idempotent, as ``close``."""
        if self._given_back:
            return
        if self._eof and self._error is None and not self._chunks:
            self._given_back = True
            self._connection.release()
        else:
            self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    async def start(self, timeout: float) -> None:
        """Wait for the answer's headers (each wait within ``timeout``). Raises ``UpstreamError`` or
        ``TimeoutError``, the connection then dropped."""
        try:
            while self.status == 0:
                if self._error is not None:
                    raise self._error
                await self._wait(timeout)
        except BaseException:
            self.close()
            raise

    async def _wait(self, timeout: float) -> None:
        """Until the connection has news for this answer, or ``TimeoutError`` after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        self._deadline = loop.time() + timeout
        self._connection.watch(loop, self._deadline)
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """The connection's timer went off: a wait past its deadline fails, one not yet due is watched on."""
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait sets a timer again
        if loop.time() >= self._deadline:
            waiter.set_exception(TimeoutError())
        else:
            self._connection.watch(loop, self._deadline)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > HIGH_WATER:
            self._connection.pause()
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._wake()

    def fail(self, error: BaseException) -> None:
        if self._error is None and not self._eof:
            self._error = error
        self._wake()


class Connection(asyncio.Protocol):
    """One keep-alive connection to an engine, answering ``httptools``'s callbacks for the answer in flight.

    Its one ``timer`` watches the deadlines of its answers' waits, and outlives them: it goes off no later
    than the deadline of the wait in progress, and when it goes off early (the deadline moved on, or the
    answer it was set for is done) the answer of the moment sets it again if it still waits. On a keep-alive
    connection each request's deadline comes after the last one's, so a request costs no timer of its own,
    where a timer set and cancelled per answer was a visible part of the guard's CPU per request."""

    def __init__(self, pool: list[Connection], everyone: set[Connection]) -> None:
        self.pool = pool  # the idle connections of its engine, which it rejoins when released
        self.everyone = everyone  # the client's connections, idle or not, until each is lost
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: Answer | None = None
        self.done = False  # the answer in flight is complete
        self.keep_alive = False  # and the engine keeps the connection open after it (read with its headers)
        self.paused = False
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0

    def watch(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """A timer at ``deadline`` unless one is set for no later."""
        if self.timer is None or deadline < self.timer_at:
            if self.timer is not None:
                self.timer.cancel()
            self.timer, self.timer_at = loop.call_at(deadline, self._expire, loop), deadline

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer = None
        if self.answer is not None:
            self.answer._expire(loop)

    def send(self, data: bytes, read_timeout: float) -> Answer:
        assert self.transport is not None and self.answer is None
        self.answer, self.done, self.keep_alive = Answer(self, read_timeout), False, False
        self.transport.write(data)
        return self.answer

    def release(self) -> None:
        """The answer was read to its end: idle again, if both sides keep the connection alive."""
        transport = self.transport
        if self.done and self.keep_alive and transport is not None and not transport.is_closing():
            self.answer = None
            self.pool.append(self)
        else:
            self.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def drained(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.everyone.add(self)

    def data_received(self, data: bytes) -> None:
        if self.answer is None:  # bytes nobody asked for: the connection cannot be trusted any more
            self.abort()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.answer.fail(BadResponse(f"the engine's answer is no valid HTTP: {exc}"))
            self.abort()

    def eof_received(self) -> bool:
        return False  # the engine closed its side: close ours

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.everyone.discard(self)
        if self in self.pool:
            self.pool.remove(self)
        if self.answer is not None:
            self.answer.fail(Reset(f"the engine's connection broke: {exc}") if exc is not None
                             else Disconnected("the engine closed the connection"))

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.answer is not None
        self.answer.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        assert self.answer is not None
        self.answer.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once the message is complete
        self.answer._wake()

    def on_body(self, body: bytes) -> None:
        assert self.answer is not None
        self.answer.feed(body)

    def on_message_complete(self) -> None:
        assert self.answer is not None
        self.done = True
        self.answer.feed_eof()


class Target:
    """A URL, split once: where to connect and the request line and headers every request to it begins with."""

    __slots__ = ("head", "host", "key", "port", "ssl")

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host, self.ssl = parts.hostname, parts.scheme == "https"
        self.port = parts.port or (443 if self.ssl else 80)
        self.key = (self.host, self.port, self.ssl)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.head = f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n".encode()


class UpstreamClient:
    """Keep-alive connections to every engine, by (host, port, TLS)."""

    def __init__(self, connect_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int, bool], list[Connection]] = {}
        self._connections: set[Connection] = set()
        self._targets: dict[str, Target] = {}  # by URL: a guard sends to a handful of them
        self._ssl: ssl.SSLContext | None = None

    async def post(self, url: str, body: bytes, headers: dict[str, str], headers_timeout: float,
                   read_timeout: float) -> Answer:
        """``send``, then wait for the answer's headers (within ``headers_timeout``, ``Answer.start``)."""
        answer = await self.send(url, body, headers, read_timeout)
        await answer.start(headers_timeout)
        return answer

    async def send(self, url: str, body: bytes, headers: dict[str, str], read_timeout: float) -> Answer:
        """Send ``body``: the answer, its headers not come yet (``Answer.start`` waits for them; meanwhile it
        can be closed). Each read of its body waits at most ``read_timeout``. Raises ``ConnectFailed``:
        nothing was sent."""
        target = self._targets.get(url)
        if target is None:
            target = self._targets[url] = Target(url)
        lines = "".join([f"{name}: {value}\r\n" for name, value in headers.items()])
        if lines.count("\n") != len(headers) or lines.count("\r") != len(headers):  # one of each per line
            raise ValueError("a header name or value holds a line break")
        connection = await self._connection(target)
        return connection.send(b"%s%sContent-Length: %d\r\n\r\n%s" % (
            target.head, lines.encode(), len(body), body), read_timeout)

    def close(self) -> None:
        """Drop every connection (shutdown): a request still waiting for its answer fails with
        ``Disconnected``."""
        for connection in list(self._connections):
            connection.abort()

    async def _connection(self, target: Target) -> Connection:
        idle = self._idle.get(target.key)
        if idle is None:
            idle = self._idle[target.key] = []
        while idle:
            connection = idle.pop()
            if connection.transport is not None and not connection.transport.is_closing():
                return connection
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, connection = await loop.create_connection(
                    lambda: Connection(idle, self._connections), target.host, target.port, ssl=self._context() if target.ssl else None)
        except (OSError, TimeoutError) as exc:
            raise ConnectFailed(f"cannot connect to {target.host}:{target.port}: {exc or type(exc).__name__}") \
                from exc
        return connection

    def _context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl
