"""Subscribes to one engine's ``/kv/events`` and keeps its ``PrefixIndex`` equal to the engine's prefix cache.

The stream (docs/kv_events.md) opens with a ``snapshot`` event (every cached block hash, the ``seq`` it
includes, the block size) and goes on with one ``blocks`` event per engine step that changed the cache,
``seq`` rising by exactly 1; ``: heartbeat`` comments while nothing changes; an ``error`` event when the
engine stops. A ``blocks`` event that does not follow on from the last ``seq`` means a batch was lost: the
copy can no longer be trusted, so the stream is dropped and the next connection starts from a fresh
snapshot. Whenever the stream is down the index is cleared and unsynced, and predicts no hits.

The reconnecting, the backoff and the staleness limit are ``SSEStream``'s (guard/pool/sse_reader.py).
"""

from __future__ import annotations

import logging

import aiohttp

from engine.protocol import KV_BLOCKS_EVENT, KV_SNAPSHOT_EVENT, KVCacheBlocks, KVCacheSnapshot
from guard.pool.prefix_index import PrefixIndex
from guard.pool.sse_reader import SSEStream

log = logging.getLogger("guard.pool.kv_events")


class KVEventSubscriber:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        engine_url: str,
        index: PrefixIndex,
        stale_s: float,
        min_backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
    ) -> None:
        self.index = index
        self.stream = SSEStream(session, engine_url.rstrip("/") + "/kv/events", stale_s, log,
                                min_backoff_s, max_backoff_s)
        self._seq: int | None = None  # the last batch applied; None until the stream's snapshot

    async def run(self) -> None:
        """Follow the stream forever (until cancelled)."""
        await self.stream.follow(self._on_field, self._on_down)

    def _on_field(self, event: str | None, data: bytes) -> None:
        if event == KV_SNAPSHOT_EVENT:
            snapshot = KVCacheSnapshot.model_validate_json(data)
            self.index.reset(snapshot.hashes, snapshot.block_size)
            self._seq = snapshot.seq
        elif event == KV_BLOCKS_EVENT:
            blocks = KVCacheBlocks.model_validate_json(data)
            if self._seq is None or blocks.seq != self._seq + 1:
                raise ValueError(f"KV events: batch {blocks.seq} after {self._seq}; resynchronizing")
            self.index.apply(blocks.stored, blocks.removed)
            self._seq = blocks.seq
        elif event == "error":  # the engine is stopping: its data is an error body
            raise ValueError(f"the engine ended the stream: {data.decode(errors='replace').strip()}")
        # Comments (heartbeats) only keep the stream alive; events of other names are not ours.

    def _on_down(self) -> None:
        self.index.clear()
        self._seq = None
