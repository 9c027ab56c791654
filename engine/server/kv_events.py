"""``GET /kv/events``: the prefix cache's block hashes as server-sent events (wire format: docs/kv_events.md).

::

    engine thread                               event loop
    ------------------------------------        ---------------------------------------------------------
    step: the pool logs stored/removed          KVEventFeed.publish(batch), with the step's outputs:
    hashes (engine/kv/events.py)                  the feed's copy of the index takes the batch, and each
    drain: one netted batch per step  ------>     subscriber's queue the encoded ``blocks`` event
    (posted with the outputs, async_engine)     handler: ``snapshot`` from the copy, then its queue's events

The feed keeps a copy of the index (the hash set and the ``seq`` of the last batch applied), built from every
batch since the pool began to record. So a new subscriber's snapshot is taken on the event loop, at once and
consistent with its ``seq``, and in the same call the subscriber joins: no batch falls between the two. The
HTTP side never waits for a step, and the engine thread only hands over a batch it drains anyway.

Bound: a subscriber whose events wait unsent beyond ``MAX_PENDING_BYTES`` (it reads slower than the cache
changes, or not at all) is dropped: its connection is reset, and it must reconnect for a fresh snapshot.
So the engine holds at most that for anyone, plus what its connection holds: aiohttp's transport buffer
(64 KiB and the event being written) and the kernel's send buffer, fixed at ``SEND_BUFFER_BYTES``.

While nothing changes, a ``: heartbeat`` comment every ``HEARTBEAT_S`` tells a live stream from a dead one;
when the engine stops, an ``error`` event ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import struct
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from aiohttp import web

from engine.kv.events import KVEventBatch
from engine.protocol import KV_BLOCKS_EVENT, KV_SNAPSHOT_EVENT, KVCacheBlocks, KVCacheSnapshot, sse_event
from engine.request_stream import EngineUnavailable
from engine.server.errors import ApiError
from engine.server.sse import open_stream, send_comment, send_error

# 4 MiB of unsent events: about 120,000 block hashes, far more than a subscriber that keeps up ever holds
# (one step's changes), far less than an engine should spend on one that does not.
MAX_PENDING_BYTES = 4 * 2**20
# A stream's kernel send buffer, fixed (the kernel doubles it for its bookkeeping): autotuning would let it
# grow to tcp_wmem's maximum (4 MiB by default) on top of the bound above. Still ample: events are small, and
# a snapshot of 100,000 hashes (3.5 MB) crosses a 1 ms link in about 15 ms.
SEND_BUFFER_BYTES = 128 * 2**10
RESET_ON_CLOSE = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends a reset
HEARTBEAT_S = 0.5  # as the telemetry stream's: a subscriber drops a stream silent for its stale limit


@dataclass(slots=True, eq=False)
class KVSubscriber:
    """One stream's queue of encoded events, filled by the feed and emptied by its handler."""

    abort: Callable[[], None]  # ends the connection at once: the feed's way to drop a subscriber
    pending: deque[bytes] = field(default_factory=deque)
    pending_bytes: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    dropped: bool = False
    error: EngineUnavailable | None = None

    async def next_events(self, timeout: float) -> bytes:
        """Every event queued since the last call, in order (b"" when none came within ``timeout``).

        Raises ``EngineUnavailable`` once the engine has stopped, ``ConnectionResetError`` once dropped."""
        if not self.pending and self.error is None and not self.dropped:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self.wake.wait()
        self.wake.clear()
        if self.dropped:
            raise ConnectionResetError("the subscriber fell behind the KV events and was dropped")
        if self.error is not None:
            raise self.error
        events = b"".join(self.pending)
        self.pending.clear()
        self.pending_bytes = 0
        return events


class KVEventFeed:
    """The event loop's side of the KV events: a copy of the index, and the fan-out to subscribers.

    Every method runs on the event loop. ``publish`` must see every batch the pool's log yields, in order
    (the engine posts them in order, with each step's outputs)."""

    def __init__(self, block_size: int, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.block_size = block_size
        self.max_pending_bytes = max_pending_bytes
        self._seq = 0
        self._hashes: set[bytes] = set()
        self._subscribers: list[KVSubscriber] = []
        self._error: EngineUnavailable | None = None

    def publish(self, batch: KVEventBatch) -> None:
        self._hashes.difference_update(batch.removed)
        self._hashes.update(batch.stored)
        self._seq = batch.seq
        if not self._subscribers:
            return
        loras: dict[str, list[bytes]] = {}
        for block_hash, name in batch.adapters.items():
            loras.setdefault(name, []).append(block_hash)
        blocks = KVCacheBlocks.model_construct(seq=batch.seq, stored=batch.stored, removed=batch.removed, loras=loras)
        event = sse_event(KV_BLOCKS_EVENT, blocks.model_dump_json())  # encoded once for every subscriber
        for subscriber in list(self._subscribers):
            subscriber.pending.append(event)
            subscriber.pending_bytes += len(event)
            if subscriber.pending_bytes > self.max_pending_bytes:
                self._drop(subscriber)
            subscriber.wake.set()

    def close(self, error: EngineUnavailable) -> None:
        """The engine has stopped: every stream, open or to come, ends with ``error``."""
        self._error = self._error or error
        for subscriber in self._subscribers:
            subscriber.error = self._error
            subscriber.wake.set()
        self._subscribers.clear()

    @contextlib.contextmanager
    def subscribe(self, abort: Callable[[], None]) -> Iterator[tuple[bytes, KVSubscriber]]:
        """The encoded snapshot event and a subscriber that gets every batch after it, while held."""
        if self._error is not None:
            raise self._error
        snapshot = KVCacheSnapshot.model_construct(seq=self._seq, block_size=self.block_size,
                                                   hashes=list(self._hashes))
        subscriber = KVSubscriber(abort)
        self._subscribers.append(subscriber)
        try:
            yield sse_event(KV_SNAPSHOT_EVENT, snapshot.model_dump_json()), subscriber
        finally:
            with contextlib.suppress(ValueError):  # dropped or closed already
                self._subscribers.remove(subscriber)

    def _drop(self, subscriber: KVSubscriber) -> None:
        self._subscribers.remove(subscriber)
        subscriber.pending.clear()
        subscriber.pending_bytes = 0
        subscriber.dropped = True
        subscriber.abort()  # its handler may be stuck writing to a full socket: end the connection under it


class KVEventsHandler:
    def __init__(self, feed: KVEventFeed) -> None:
        self.feed = feed

    async def stream(self, http: web.Request) -> web.StreamResponse:
        """The ``snapshot`` event, then a ``blocks`` event per batch; heartbeats while idle (module docstring)."""
        response = await open_stream(http)
        transport = http.transport
        try:
            if transport is None:
                raise ConnectionResetError("the subscriber left")
            transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            with self.feed.subscribe(functools.partial(_reset, transport)) as (snapshot, subscriber):
                await response.write(snapshot)
                while True:
                    events = await subscriber.next_events(HEARTBEAT_S)
                    if events:
                        await response.write(events)
                    else:
                        await send_comment(response, "heartbeat")
        except EngineUnavailable as exc:
            with contextlib.suppress(ConnectionResetError):  # at shutdown the subscriber may be gone already
                await send_error(response, ApiError.from_engine(exc))
        except ConnectionResetError:
            pass  # the subscriber left, or was dropped
        return response


def _reset(transport: asyncio.Transport) -> None:
    """End a connection with a reset, not a close: the kernel drops what it still holds for a stalled reader
    at once, instead of keeping it, orphaned, until the reader reads or TCP gives up."""
    if transport.is_closing():
        return
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET_ON_CLOSE)
    transport.abort()
