"""The shared batch store (store.py states what every store guarantees): every guard on one Redis sees the
same files, batches, results and leases, under keys that begin ``kvguard:batch:``.

- ``f:<id>`` a file's description, ``fc:<id>`` its bytes, ``tf:<tenant>`` its tenant's file ids, newest first;
- ``b:<id>`` a batch, ``x:<id>`` its ``cancelling_at`` (apart: a cancel never races a save), ``tb:<tenant>``
  its tenant's batch ids, newest first, ``open`` the batches a runner still has work on, ``status`` each
  batch's status (for ``guard_batches``);
- ``r:<id>`` its results by line (``HSETNX``: the first kept wins), ``c:<id>`` their counts by kind, kept
  in the same script as the result, so the counts are the results';
- ``l:<id>`` its lease: the owner's name, expiring after the TTL (taken with ``SET NX``, renewed only by
  its owner, in one script).

A file's bytes go in before its description, so a description always has its bytes. The client is this
store's own, with a timeout far above shared state's (an upload may be 200 MB).
"""

from __future__ import annotations

import json

import redis.asyncio as aioredis

from guard.batch.objects import OPEN, BatchObject, FileObject

P = "kvguard:batch:"
RECORD = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[3]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
return 1
"""
ACQUIRE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


class RedisBatchStore:
    def __init__(self, url: str) -> None:
        self.client = aioredis.Redis.from_url(url, socket_timeout=60, socket_connect_timeout=5)
        self._record = self.client.register_script(RECORD)
        self._acquire = self.client.register_script(ACQUIRE)
        self._release = self.client.register_script(RELEASE)

    # -- files ----------------------------------------------------------------------------------------------
    async def add_file(self, file: FileObject, content: bytes) -> None:
        await self.client.set(P + "fc:" + file.id, content)
        meta = {name: getattr(file, name) for name in FileObject.__slots__}
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(P + "f:" + file.id, json.dumps(meta))
            pipe.lrem(P + "tf:" + file.tenant, 0, file.id)
            pipe.lpush(P + "tf:" + file.tenant, file.id)
            await pipe.execute()

    async def file(self, tenant: str, file_id: str) -> FileObject | None:
        raw = await self.client.get(P + "f:" + file_id)
        found = FileObject(**json.loads(raw)) if raw is not None else None
        return found if found is not None and found.tenant == tenant else None

    async def files(self, tenant: str) -> list[FileObject]:
        ids = await self.client.lrange(P + "tf:" + tenant, 0, -1)
        if not ids:
            return []
        raws = await self.client.mget([P + "f:" + i.decode() for i in ids])
        return [FileObject(**json.loads(raw)) for raw in raws if raw is not None]

    async def content(self, file_id: str) -> bytes | None:
        return await self.client.get(P + "fc:" + file_id)

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        if await self.file(tenant, file_id) is None:
            return False
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(P + "f:" + file_id, P + "fc:" + file_id)
            pipe.lrem(P + "tf:" + tenant, 0, file_id)
            await pipe.execute()
        return True

    # -- batches --------------------------------------------------------------------------------------------
    async def add_batch(self, batch: BatchObject) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(P + "b:" + batch.id, json.dumps(batch.to_json()))
            pipe.hset(P + "status", batch.id, batch.status)
            pipe.sadd(P + "open", batch.id)
            pipe.lpush(P + "tb:" + batch.tenant, batch.id)
            await pipe.execute()

    async def batch(self, tenant: str | None, batch_id: str) -> BatchObject | None:
        raw, at = await self.client.mget([P + "b:" + batch_id, P + "x:" + batch_id])
        if raw is None:
            return None
        found = BatchObject.from_json(json.loads(raw), int(at) if at is not None else None)
        return found if tenant is None or found.tenant == tenant else None

    async def _many(self, ids: list[bytes]) -> list[BatchObject]:
        if not ids:
            return []
        names = [i.decode() for i in ids]
        raws = await self.client.mget([P + "b:" + i for i in names] + [P + "x:" + i for i in names])
        metas, ats = raws[:len(names)], raws[len(names):]
        return [BatchObject.from_json(json.loads(raw), int(at) if at is not None else None)
                for raw, at in zip(metas, ats, strict=True) if raw is not None]

    async def batches(self, tenant: str) -> list[BatchObject]:
        return await self._many(await self.client.lrange(P + "tb:" + tenant, 0, -1))

    async def save_batch(self, batch: BatchObject) -> None:
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.set(P + "b:" + batch.id, json.dumps(batch.to_json()))
            pipe.hset(P + "status", batch.id, batch.status)
            if batch.status in OPEN:
                pipe.sadd(P + "open", batch.id)
            else:
                pipe.srem(P + "open", batch.id)
            await pipe.execute()

    async def cancel(self, batch_id: str, at: int) -> None:
        await self.client.set(P + "x:" + batch_id, at, nx=True)

    async def open_batches(self) -> list[BatchObject]:
        return await self._many(sorted(await self.client.smembers(P + "open")))

    async def statuses(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for status in await self.client.hvals(P + "status"):
            counts[status.decode()] = counts.get(status.decode(), 0) + 1
        return counts

    # -- results --------------------------------------------------------------------------------------------
    async def record(self, batch_id: str, index: int, ok: bool, line: bytes) -> bool:
        kept = await self._record(keys=[P + "r:" + batch_id, P + "c:" + batch_id],
                                  args=[index, "ok" if ok else "failed", (b"1" if ok else b"0") + line])
        return bool(kept)

    async def results(self, batch_id: str) -> dict[int, tuple[bool, bytes]]:
        found = await self.client.hgetall(P + "r:" + batch_id)
        return {int(index): (value[:1] == b"1", value[1:]) for index, value in found.items()}

    async def counts(self, batch_id: str) -> tuple[int, int]:
        ok, failed = await self.client.hmget(P + "c:" + batch_id, ["ok", "failed"])
        return int(ok or 0), int(failed or 0)

    # -- leases ---------------------------------------------------------------------------------------------
    async def acquire(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        return bool(await self._acquire(keys=[P + "l:" + batch_id], args=[owner, int(ttl_s * 1000)]))

    async def release(self, batch_id: str, owner: str) -> None:
        await self._release(keys=[P + "l:" + batch_id], args=[owner])

    async def close(self) -> None:
        await self.client.aclose()
