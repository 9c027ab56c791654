"""Following one of an engine's server-sent-event streams forever: reconnects, backoff, and the SSE lines.

``SSEStream.follow`` hands every ``data:`` line (with the name of its event, "" for an unnamed one) and every
comment to a handler; a handler that raises ``ValueError`` (pydantic's ``ValidationError`` is one) drops the
stream. The stream reconnects forever with exponential backoff, reset once the handler has accepted data:
comments alone (heartbeats) do not prove the other side works. A stream that sends no byte at all, not
even a heartbeat, for ``stale_s`` is dropped as dead, whatever TCP thinks. Every end of a stream, clean or
not, is reported to ``on_down`` before the next attempt, so what the stream fed can be marked stale at once.

Lines are split here rather than by aiohttp's ``readline``, which refuses lines over 128 KiB: one event is
one line (engine/protocol.py frames them so), and a KV snapshot (guard/pool/kv_events.py) can run to
megabytes. ``MAX_LINE_BYTES`` bounds what a broken upstream can make the guard buffer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Callable

import aiohttp

MAX_LINE_BYTES = 64 * 2**20

# (event name, data) for a data line; (None, text) for a comment.
FieldHandler = Callable[[str | None, bytes], None]


class SSEStream:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        stale_s: float,
        log: logging.Logger,
        min_backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
    ) -> None:
        self.session = session
        self.url = url
        self.log = log
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=stale_s, sock_read=stale_s)
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self._backoff = min_backoff_s

    async def follow(self, on_field: FieldHandler, on_down: Callable[[], None]) -> None:
        """Feed every field of the stream to ``on_field``, reconnecting forever (module docstring)."""
        while True:
            try:
                await self._read(on_field)
                reason = "the stream ended"
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                reason = str(exc) or type(exc).__name__
            finally:
                on_down()
            self.log.warning("%s: %s; reconnecting in %.2f s", self.url, reason, self._backoff)
            await asyncio.sleep(self._backoff)
            self._backoff = min(self._backoff * 2, self.max_backoff_s)

    async def _read(self, on_field: FieldHandler) -> None:
        async with self.session.get(self.url, timeout=self.timeout) as response:
            if response.status != 200:
                raise aiohttp.ClientResponseError(response.request_info, (), status=response.status)
            event = ""  # the name of the event being read; "" for an unnamed one
            async for line in lines(response.content.iter_any()):
                if not line:  # a blank line ends the event
                    event = ""
                elif line.startswith(b":"):
                    on_field(None, line[1:].removeprefix(b" "))
                elif line.startswith(b"event:"):
                    event = line[6:].strip().decode()
                elif line.startswith(b"data:"):
                    on_field(event, line[5:].removeprefix(b" "))
                    self._backoff = self.min_backoff_s


async def lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The lines of a byte stream, without their line ends; a line longer than ``MAX_LINE_BYTES`` is a
    ``ValueError``. Linear in the bytes however long the lines."""
    parts: list[bytes] = []
    size = 0
    async for chunk in chunks:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            parts.append(chunk[start:end])
            line = b"".join(parts)
            parts.clear()
            size = 0
            yield line.removesuffix(b"\r")
            start = end + 1
        if start < len(chunk):
            parts.append(chunk[start:])
            size += len(chunk) - start
            if size > MAX_LINE_BYTES:
                raise ValueError(f"an event line longer than {MAX_LINE_BYTES} bytes")
