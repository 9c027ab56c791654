"""Both batch stores keep the guarantees the runner relies on (guard/batch/store.py), each checked on the
embedded store (SQLite) and on a real Redis: the first result of a line wins, one owner holds a lease until
it lapses, a cancel is kept apart from saves, and lookups are per tenant."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from support.redis_server import RedisServer

from guard.batch.objects import BatchObject, FileObject, now
from guard.batch.redis_store import RedisBatchStore
from guard.batch.sqlite_store import SqliteBatchStore
from guard.batch.store import BatchStore


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(params=["sqlite", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[BatchStore]:
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        made: BatchStore = RedisBatchStore(server.url)
        await made.client.flushdb()  # type: ignore[attr-defined]
    else:
        made = SqliteBatchStore(tmp_path)
    yield made
    await made.close()


def a_batch(tenant: str = "acme", total: int = 3) -> BatchObject:
    created = now()
    return BatchObject(f"batch_{tenant}{total}", tenant, "/v1/completions", "file-x", "24h", created, created + 60,
                       total, "tiny")


async def test_the_first_result_of_a_line_wins(store: BatchStore) -> None:
    batch = a_batch()
    await store.add_batch(batch)
    assert await store.record(batch.id, 0, True, b"first")
    assert not await store.record(batch.id, 0, False, b"second"), "a line is answered once"
    assert await store.record(batch.id, 1, False, b"error")
    assert await store.results(batch.id) == {0: (True, b"first"), 1: (False, b"error")}
    assert await store.counts(batch.id) == (1, 1)


async def test_one_owner_holds_a_lease_until_it_lapses(store: BatchStore) -> None:
    assert await store.acquire("batch_a", "g1", 0.3)
    assert not await store.acquire("batch_a", "g2", 0.3), "one guard runs a batch at a time"
    assert await store.acquire("batch_a", "g1", 0.3), "its owner renews it"
    await asyncio.sleep(0.4)
    assert await store.acquire("batch_a", "g2", 5), "a lapsed lease is taken over"
    await store.release("batch_a", "g1")  # not g1's any more: nothing happens
    assert not await store.acquire("batch_a", "g1", 5)
    await store.release("batch_a", "g2")
    assert await store.acquire("batch_a", "g1", 5)


async def test_a_cancel_survives_a_save_and_open_batches_follow_status(store: BatchStore) -> None:
    batch = a_batch()
    await store.add_batch(batch)
    assert [b.id for b in await store.open_batches()] == [batch.id]
    await store.cancel(batch.id, 123)
    batch.status = "in_progress"
    await store.save_batch(batch)  # a runner's save, made before it saw the cancel
    seen = await store.batch("acme", batch.id)
    assert seen is not None and seen.cancelling_at == 123 and seen.shown_status() == "cancelling"
    batch.status = "cancelled"
    await store.save_batch(batch)
    assert await store.open_batches() == []
    assert (await store.statuses()).get("cancelled") == 1


async def test_lookups_are_per_tenant(store: BatchStore) -> None:
    file = FileObject("file-1", "acme", "in.jsonl", "batch", 3, now(), 1)
    await store.add_file(file, b"abc")
    batch = a_batch()
    await store.add_batch(batch)
    assert await store.file("globex", file.id) is None and await store.batch("globex", batch.id) is None
    assert await store.files("globex") == [] and await store.batches("globex") == []
    assert not await store.delete_file("globex", file.id)
    assert (await store.file("acme", file.id)) == file and await store.content(file.id) == b"abc"
    assert [b.id for b in await store.batches("acme")] == [batch.id]
    assert await store.delete_file("acme", file.id) and await store.content(file.id) is None
