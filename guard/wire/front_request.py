"""A request the guard's front (guard/wire/front.py) serves itself, and the answers it writes for it.

``FrontRequest`` is the part of aiohttp's ``web.Request`` that the completion pipeline reads (headers, path,
the app, the per-request keys, the body, the transport), so the pipeline runs unchanged on either. Its
body arrives through the front's parser; ``read`` waits for it. ``FrontStream`` is the part of
``web.StreamResponse`` the relay writes a stream with: HTTP/1.1 chunked, back-pressured by the transport
(a write waits while the transport's buffer is above its high-water mark). ``head`` frames a response's
status line and headers as aiohttp does: the response's own headers in order, then ``Content-Length``
(or ``Transfer-Encoding``), ``Date``, ``Server`` and, on a connection that will close, ``Connection``.

Invariant: the bytes of one answer go to the transport in order and only while it is that request's turn
(the front serves a connection's requests one at a time, pipelined ones in order).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE
from multidict import CIMultiDict

REASONS = {status.value: status.phrase for status in HTTPStatus}
CHUNKED_EOF = b"0\r\n\r\n"
SERVER = f"Server: {SERVER_SOFTWARE}\r\n"


def head(status: int, headers: Iterable[tuple[str, str]], framing: str, keep_alive: bool) -> bytes:
    """The status line and headers of an answer (``framing``: its ``Content-Length: n`` or
    ``Transfer-Encoding: chunked`` line, which goes after the answer's own headers, as aiohttp puts it)."""
    own = "".join([f"{name}: {value}\r\n" for name, value in headers])
    close = "" if keep_alive else "Connection: close\r\n"
    return (f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\n{own}{framing}\r\n"
            f"Date: {rfc822_formatted_time()}\r\n{SERVER}{close}\r\n").encode("utf-8", "surrogateescape")


class Flow:
    """The connection's side of writing: whether its transport has paused writers, and the one waiter."""

    __slots__ = ("lost", "paused", "waiter")

    def __init__(self) -> None:
        self.paused = False
        self.lost = False
        self.waiter: asyncio.Future[None] | None = None

    async def drain(self) -> None:
        if self.lost:
            raise ConnectionResetError("the client connection is closed")
        if not self.paused:
            return
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def wake(self, exc: Exception | None = None) -> None:
        if (waiter := self.waiter) is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)


class RequestItems:
    """A request's keys, as on a ``web.Request`` (``request[KEY]``), kept in its ``items`` dict: shared by the
    front's requests and the ones the guard makes itself (guard/batch/line.py). No slots of its own, so a
    slotted subclass stays slotted."""

    __slots__ = ()
    items: dict[Any, Any]

    def __getitem__(self, key: Any) -> Any:
        return self.items[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[key] = value

    def __contains__(self, key: object) -> bool:
        return key in self.items

    def get(self, key: Any, default: Any = None) -> Any:
        return self.items.get(key, default)


class FrontRequest(RequestItems):
    """One request on a front connection: what the pipeline reads of a ``web.Request`` (see the module)."""

    __slots__ = (
        "app",
        "body_done",
        "flow",
        "headers",
        "items",
        "keep_alive",
        "limit",
        "method",
        "parts",
        "path",
        "raw_path",
        "size",
        "too_large",
        "transport",
        "waiter",
        "written",
    )

    def __init__(self, app: web.Application, transport: asyncio.Transport, flow: Flow, method: str, url: str,
                 headers: CIMultiDict[str], keep_alive: bool, limit: int) -> None:
        self.app = app
        self.transport: asyncio.Transport | None = transport
        self.flow = flow
        self.method = method
        self.raw_path = url
        self.path = url.split("?", 1)[0]
        self.headers = headers  # never changed once parsed (aiohttp's is a read-only proxy)
        self.keep_alive = keep_alive
        self.items: dict[Any, Any] = {}
        self.parts: list[bytes] = []
        self.size = 0
        self.limit = limit  # bytes of body kept at most: past it, ``read`` raises 413
        self.body_done = False
        self.too_large = False
        self.waiter: asyncio.Future[None] | None = None
        self.written = 0  # bytes of the answer handed to the transport

    # -- headers ------------------------------------------------------------------------------------------
    @property
    def content_length(self) -> int | None:
        value = self.headers.get("Content-Length")
        return int(value) if value is not None and value.isdigit() else None

    @property
    def content_type(self) -> str:
        value = self.headers.get("Content-Type")
        if not value:
            return "application/octet-stream"
        return value.split(";", 1)[0].strip().lower()

    # -- the body -----------------------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        self.size += len(data)
        if self.size <= self.limit:
            self.parts.append(data)
        elif not self.too_large:
            self.too_large, self.parts = True, []
            self._wake()  # a read waiting for the rest refuses at once

    def finish_body(self) -> None:
        self.body_done = True
        self._wake()

    def _wake(self) -> None:
        if (waiter := self.waiter) is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def content(self) -> FrontRequest:
        """As ``web.Request.content``: ``is_eof`` and ``read_nowait``."""
        return self

    def is_eof(self) -> bool:
        """The body is whole, and kept: one past ``limit`` never is (``read`` refuses it)."""
        return self.body_done and not self.too_large

    def read_nowait(self) -> bytes:
        return b"".join(self.parts)

    async def read(self) -> bytes:
        """The whole body; ``HTTPRequestEntityTooLarge`` past ``limit`` (as aiohttp's ``client_max_size``)."""
        while not self.body_done and not self.too_large:
            if self.transport is None:
                raise ConnectionResetError("the client connection is closed")
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        if self.too_large:
            raise web.HTTPRequestEntityTooLarge(max_size=self.limit, actual_size=self.size)
        return self.read_nowait()

    def lost(self) -> None:
        """The connection went: a read still waiting ends with ``ConnectionResetError``."""
        self.transport = None
        if (waiter := self.waiter) is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client connection is closed"))

    # -- answers ------------------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client connection is closed")
        self.written += len(data)
        self.transport.write(data)

    def start_stream(self, status: int, headers: dict[str, str]) -> FrontStream:
        """Send a chunked answer's head; its body follows through the returned stream."""
        self.write(head(status, headers.items(), "Transfer-Encoding: chunked", self.keep_alive))
        return FrontStream(self, status, headers)  # which holds the request, never the other way: no cycle


class FrontStream:
    """A chunked answer on a ``FrontRequest``: ``write`` and ``write_eof`` as on a prepared
    ``web.StreamResponse``."""

    __slots__ = ("eof_sent", "headers", "request", "status")

    prepared = True

    def __init__(self, request: FrontRequest, status: int, headers: dict[str, str]) -> None:
        self.request = request
        self.status = status
        self.headers = headers
        self.eof_sent = False

    async def write(self, data: bytes) -> None:
        if self.eof_sent:
            raise RuntimeError("cannot write to a stream that has ended")
        if data:
            self.request.write(b"%x\r\n%b\r\n" % (len(data), data))
            await self.request.flow.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        if self.eof_sent:
            return
        if data:
            await self.write(data)
        self.request.write(CHUNKED_EOF)
        self.eof_sent = True
