"""KV-cache events end to end: the engine's ``/kv/events`` stream, and the guard's ``PrefixIndex`` kept by a
real ``KVEventSubscriber``, which must predict exactly the prefix hits the engine then reports."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import random
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st
from support.engine_server import ServerThread
from support.loop_thread import AppThread
from support.wait import until

from engine.kv.block_pool import BlockPool
from engine.kv.events import KVEventLog
from engine.protocol import sse_event
from guard.pool.kv_events import KVEventSubscriber
from guard.pool.prefix_index import PrefixIndex, prompt_block_hashes
from guard.pool.sse_reader import lines

BLOCK_SIZE = 4
NUM_BLOCKS = 512  # 2048 token slots: three 800-token prompts overflow it, so blocks are evicted


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE) as running:
        yield running


def tokens(seed: int, n: int) -> list[int]:
    """``n`` token ids of the tiny model's byte range, the same for the same seed (and unlike any other)."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def engine_hashes(server: ServerThread) -> set[bytes]:
    """The engine pool's hash index, read on its loop while the engine is idle."""
    pool = server.core.kv.pool
    return server.call(lambda: {b.block_hash for b in pool.blocks if b.block_hash is not None})


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int], salt: str | None = None,
                   max_tokens: int = 1) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    async with session.post(url + "/v1/completions", json=body) as answer:
        assert answer.status == 200, await answer.text()
        return await answer.json()


async def hits_total(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url + "/telemetry") as answer:
        return (await answer.json())["prefix_cache_hits_total"]


@contextlib.asynccontextmanager
async def subscribed(session: aiohttp.ClientSession, url: str) -> AsyncIterator[PrefixIndex]:
    """A real subscriber on this test's loop, keeping an index until the block ends; yields once synced."""
    index = PrefixIndex()
    task = asyncio.create_task(KVEventSubscriber(session, url, index, stale_s=2.0).run())
    try:
        await until(lambda: index.synced, bool, 5)
        yield index
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def in_sync(index: PrefixIndex, server: ServerThread) -> None:
    """Wait until the index equals the (idle) engine's pool: the stream has delivered everything."""
    await until(lambda: index.hashes == engine_hashes(server), bool, 5,
                message=lambda: f"index {len(index)} hashes, engine {len(engine_hashes(server))}")


async def predicted_then_served(session: aiohttp.ClientSession, server: ServerThread, index: PrefixIndex,
                                prompt: list[int], salt: str | None = None) -> tuple[int, int, int]:
    """The tokens the index predicts the engine will take from its cache, then what it reports: in the
    response's usage, and as the growth of its ``prefix_cache_hits_total``."""
    predicted = index.leading_cached(prompt_block_hashes(prompt, index.block_size, salt)) * index.block_size
    before = await hits_total(session, server.url)
    usage = (await complete(session, server.url, prompt, salt))["usage"]
    return predicted, usage["prompt_tokens_details"]["cached_tokens"], await hits_total(session, server.url) - before


async def test_the_index_predicts_exactly_the_engines_prefix_hits(server: ServerThread) -> None:
    shared = tokens(1, 30)
    async with aiohttp.ClientSession() as session, subscribed(session, server.url) as index:
        assert index.block_size == BLOCK_SIZE
        await complete(session, server.url, shared + tokens(2, 10))
        await in_sync(index, server)
        # A different tail after 30 shared tokens: 7 whole blocks are shared, the 8th mixes in the new tail.
        assert await predicted_then_served(session, server, index, shared + tokens(3, 10)) == (28, 28, 28)
        await in_sync(index, server)
        # An exact repeat of 32 tokens: 8 blocks are cached, but the last token is always computed, so 7 hit.
        exact = tokens(4, 32)
        await complete(session, server.url, exact)
        await in_sync(index, server)
        assert await predicted_then_served(session, server, index, exact) == (28, 28, 28)
        await in_sync(index, server)
        # The same tokens under another cache salt (another tenant) share nothing.
        assert await predicted_then_served(session, server, index, exact, salt="other") == (0, 0, 0)


async def test_evictions_reach_the_index_and_a_fresh_snapshot_equals_it(server: ServerThread) -> None:
    first, second, third = tokens(10, 800), tokens(11, 800), tokens(12, 800)
    async with aiohttp.ClientSession() as session, subscribed(session, server.url) as index:
        await complete(session, server.url, first)
        await in_sync(index, server)
        first_hashes = prompt_block_hashes(first, BLOCK_SIZE, None)
        assert index.leading_cached(first_hashes) == len(first_hashes) == 199
        await complete(session, server.url, second)
        await complete(session, server.url, third)  # 600 blocks in a pool of 512: the oldest tails go
        await in_sync(index, server)
        assert not set(first_hashes) <= index.hashes, "evicted blocks left the index"
        assert len(index) <= NUM_BLOCKS
        # A repeat of the first prompt now hits only the leading blocks that survived (tails go first).
        predicted, cached, hits = await predicted_then_served(session, server, index, first)
        assert 0 < predicted < 199 * BLOCK_SIZE and predicted == cached == hits
        await in_sync(index, server)
        async with subscribed(session, server.url) as fresh:
            assert fresh.hashes == index.hashes == engine_hashes(server)


async def read_events(response: aiohttp.ClientResponse, into: list[tuple[str, dict[str, Any]]]) -> None:
    event = ""
    async for line in lines(response.content.iter_any()):
        if line.startswith(b"event:"):
            event = line[6:].strip().decode()
        elif line.startswith(b"data:"):
            into.append((event, json.loads(line[5:])))


def replay(events: list[tuple[str, dict[str, Any]]]) -> set[str]:
    """The hashes a stream's events add up to, checking each batch against the set it applies to."""
    (kind, snapshot), *batches = events
    assert kind == "snapshot" and len(snapshot["hashes"]) == len(set(snapshot["hashes"]))
    cached = set(snapshot["hashes"])
    for _, batch in batches:
        stored, removed = set(batch["stored"]), set(batch["removed"])
        assert stored or removed, "an empty batch is never sent"
        assert not stored & cached and removed <= cached, "stored hashes were absent, removed ones present"
        cached = (cached - removed) | stored
    return cached


async def test_a_stream_is_a_snapshot_then_one_nonempty_batch_per_seq(server: ServerThread) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    async with aiohttp.ClientSession() as session, session.get(server.url + "/kv/events") as stream:
        assert stream.headers["Content-Type"] == "text/event-stream"
        reader = asyncio.create_task(read_events(stream, events))
        await asyncio.gather(*(complete(session, server.url, tokens(20 + i, 300), max_tokens=8) for i in range(8)))
        engine = {h.hex() for h in engine_hashes(server)}
        await until(lambda: events and replay(events) == engine, bool, 5)
        reader.cancel()
    (_, snapshot), *batches = events
    assert snapshot["block_size"] == BLOCK_SIZE
    assert batches and {kind for kind, _ in batches} == {"blocks"}
    assert [b["seq"] for _, b in batches] == list(range(snapshot["seq"] + 1, snapshot["seq"] + 1 + len(batches)))
    assert any(batch["removed"] for _, batch in batches), "the load overflows the pool: blocks are evicted"


@given(st.lists(st.one_of(st.integers(0, 5), st.none()), max_size=80))
def test_drained_batches_add_up_to_the_pools_index(ops: list[int | None]) -> None:
    """Fill blocks of a small pool with one of a few hashes (so hashes are evicted and come back, often
    within one drain), draining now and then: the batches, applied in order, always give the index."""
    pool = BlockPool(3)
    (held,) = pool.allocate(1)
    pool.register(held, b"held".ljust(16))  # indexed before recording starts: the log's first batch has it
    log = pool.record_events()
    mirror: set[bytes] = set()
    seq = 0
    for op in [*ops, None]:
        if op is None:
            batch = log.drain()
            if batch is not None:
                seq += 1
                assert batch.seq == seq and (batch.stored or batch.removed)
                assert not set(batch.stored) & mirror and set(batch.removed) <= mirror
                mirror = (mirror - set(batch.removed)) | set(batch.stored)
        else:
            (block,) = pool.allocate(1)  # evicts the least recently freed block's hash, if it has one
            pool.register(block, bytes([op]) * 16)
            pool.free([block])
    assert mirror == {b.block_hash for b in pool.blocks if b.block_hash is not None}


def test_a_log_nets_a_hash_stored_and_removed_within_one_step() -> None:
    log = KVEventLog()
    log.stored += [b"a", b"b"]
    log.removed += [b"a"]
    batch = log.drain()
    assert batch is not None and (batch.seq, batch.stored, batch.removed) == (1, [b"b"], [])
    log.removed += [b"b"]
    log.stored += [b"b"]
    assert log.drain() is None and log.seq == 1, "a change that cancels out is no batch and takes no seq"


async def test_a_stalled_subscriber_is_dropped_and_the_engine_goes_on() -> None:
    # One block per token: every prompt token is an event, so a stalled reader's buffers fill in a few requests.
    with ServerThread(num_blocks=1024, block_size=1) as engine:
        feed = engine.server.engine.kv_events
        engine.call(lambda: setattr(feed, "max_pending_bytes", 64 * 2**10))  # the 4 MiB default takes longer
        host, port = engine.url.removeprefix("http://").rsplit(":", 1)
        with socket.socket() as stalled:
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # so the engine's side fills up
            stalled.connect((host, int(port)))
            stalled.sendall(b"GET /kv/events HTTP/1.1\r\nHost: engine\r\n\r\n")
            async with aiohttp.ClientSession() as session:
                deadline = time.monotonic() + 10
                seed = 100
                # Never read: the engine must reset the connection (a reset shows on a socket nobody reads).
                while (error := stalled.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)) == 0:
                    assert time.monotonic() < deadline, "the stalled subscriber was never dropped"
                    await asyncio.gather(*(complete(session, engine.url, tokens(seed + i, 1000)) for i in range(2)))
                    seed += 2
                assert error == errno.ECONNRESET
                async with subscribed(session, engine.url) as fresh:  # the engine serves the next one as ever
                    await in_sync(fresh, engine)


async def test_a_stopped_engine_unsyncs_the_index() -> None:
    with ServerThread(num_blocks=16, block_size=BLOCK_SIZE) as engine:
        async with aiohttp.ClientSession() as session, subscribed(session, engine.url) as index:
            await complete(session, engine.url, tokens(30, 20))
            await in_sync(index, engine)
            assert len(index) == 5  # 20 prompt tokens: 5 full blocks
            engine.run(engine.server.engine.shutdown())  # the engine stops: its stream ends with an error event
            await until(lambda: not index.synced, bool, 5)
            assert len(index) == 0 and index.leading_cached(prompt_block_hashes(tokens(30, 20), BLOCK_SIZE, None)) == 0


class GappyEngine(AppThread):
    """An engine's ``/kv/events`` that loses batch 2 on its first connection (a real engine cannot be made
    to): the subscriber must drop that stream and start over from the next one's snapshot."""

    def __init__(self) -> None:
        super().__init__("gappy-engine", handler_cancellation=True, shutdown_timeout=1)
        self.connections = 0

    def make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/kv/events", self.events)
        return app

    async def events(self, http: web.Request) -> web.StreamResponse:
        self.connections += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(http)
        if self.connections == 1:
            await response.write(snapshot(0, [b"a" * 16]) + blocks(1, [b"b" * 16], []) + blocks(3, [b"c" * 16], []))
        else:
            await response.write(snapshot(7, [b"d" * 16]))
        await asyncio.sleep(60)
        return response


def snapshot(seq: int, hashes: list[bytes]) -> bytes:
    return sse_event("snapshot", json.dumps({"seq": seq, "block_size": 4, "hashes": [h.hex() for h in hashes]}))


def blocks(seq: int, stored: list[bytes], removed: list[bytes]) -> bytes:
    return sse_event("blocks", json.dumps({"seq": seq, "stored": [h.hex() for h in stored],
                                           "removed": [h.hex() for h in removed]}))


async def test_a_seq_gap_drops_the_stream_and_resyncs_from_a_fresh_snapshot() -> None:
    with GappyEngine() as engine:
        async with aiohttp.ClientSession() as session, subscribed(session, engine.url) as index:
            await until(lambda: engine.connections, lambda n: n >= 2, 5)
            await until(lambda: index.hashes, lambda h: h == {b"d" * 16}, 5)
            assert index.synced
