"""The embedded batch store (store.py states what every store guarantees): SQLite in WAL mode at
``batch.store/batches.db`` and each file's bytes at ``batch.store/files/<id>``.

Every statement runs on one thread of its own, in order, so the event loop never waits on the disk and the
one connection is never used by two threads. A file's bytes are written (and synced) before its row, so a
row always has its bytes; a result is one ``INSERT OR IGNORE`` on the line's key, so the first kept wins.
WAL lets the guard processes of one host (``--workers N``) share the database; the lease is a row.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from guard.batch.objects import OPEN, BatchObject, FileObject

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, meta TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, status TEXT NOT NULL,
                                    meta TEXT NOT NULL, cancelling_at INTEGER);
CREATE TABLE IF NOT EXISTS results (batch TEXT NOT NULL, idx INTEGER NOT NULL, ok INTEGER NOT NULL,
                                    line BLOB NOT NULL, PRIMARY KEY (batch, idx));
CREATE TABLE IF NOT EXISTS leases (batch TEXT PRIMARY KEY, owner TEXT NOT NULL, until REAL NOT NULL);
"""


class SqliteBatchStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / "files"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batch-store")
        self._db: sqlite3.Connection = self._thread.submit(self._connect).result()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.root / "batches.db", timeout=30, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(SCHEMA)
        return db

    async def _run(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, work)

    def _rows(self, sql: str, *args: Any) -> list[tuple]:
        return self._db.execute(sql, args).fetchall()

    # -- files ----------------------------------------------------------------------------------------------
    async def add_file(self, file: FileObject, content: bytes) -> None:
        def work() -> None:
            path = self.blobs / file.id
            with open(path, "wb") as out:
                out.write(content)
                out.flush()
                os.fsync(out.fileno())
            self._db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?)",
                             (file.id, file.tenant, json.dumps(_file_json(file))))

        await self._run(work)

    async def file(self, tenant: str, file_id: str) -> FileObject | None:
        rows = await self._run(lambda: self._rows("SELECT meta FROM files WHERE id=? AND tenant=?", file_id, tenant))
        return FileObject(**json.loads(rows[0][0])) if rows else None

    async def files(self, tenant: str) -> list[FileObject]:
        rows = await self._run(lambda: self._rows("SELECT meta FROM files WHERE tenant=? ORDER BY rowid DESC", tenant))
        return [FileObject(**json.loads(meta)) for (meta,) in rows]

    async def content(self, file_id: str) -> bytes | None:
        path = self.blobs / file_id
        return await self._run(lambda: path.read_bytes() if path.is_file() else None)

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        def work() -> bool:
            gone = self._db.execute("DELETE FROM files WHERE id=? AND tenant=?", (file_id, tenant)).rowcount > 0
            if gone:
                (self.blobs / file_id).unlink(missing_ok=True)
            return gone

        return await self._run(work)

    # -- batches --------------------------------------------------------------------------------------------
    async def add_batch(self, batch: BatchObject) -> None:
        await self._run(lambda: self._db.execute("INSERT INTO batches VALUES (?, ?, ?, ?, NULL)", (
            batch.id, batch.tenant, batch.status, json.dumps(batch.to_json()))))

    async def batch(self, tenant: str | None, batch_id: str) -> BatchObject | None:
        sql = "SELECT meta, cancelling_at FROM batches WHERE id=?" + (" AND tenant=?" if tenant else "")
        rows = await self._run(lambda: self._rows(sql, batch_id, *([tenant] if tenant else [])))
        return BatchObject.from_json(json.loads(rows[0][0]), rows[0][1]) if rows else None

    async def batches(self, tenant: str) -> list[BatchObject]:
        rows = await self._run(lambda: self._rows(
            "SELECT meta, cancelling_at FROM batches WHERE tenant=? ORDER BY rowid DESC", tenant))
        return [BatchObject.from_json(json.loads(meta), at) for meta, at in rows]

    async def save_batch(self, batch: BatchObject) -> None:
        await self._run(lambda: self._db.execute("UPDATE batches SET status=?, meta=? WHERE id=?", (
            batch.status, json.dumps(batch.to_json()), batch.id)))

    async def cancel(self, batch_id: str, at: int) -> None:
        await self._run(lambda: self._db.execute(
            "UPDATE batches SET cancelling_at=? WHERE id=? AND cancelling_at IS NULL", (at, batch_id)))

    async def open_batches(self) -> list[BatchObject]:
        marks = ",".join("?" * len(OPEN))
        rows = await self._run(lambda: self._rows(
            f"SELECT meta, cancelling_at FROM batches WHERE status IN ({marks}) ORDER BY rowid", *OPEN))
        return [BatchObject.from_json(json.loads(meta), at) for meta, at in rows]

    async def statuses(self) -> dict[str, int]:
        rows = await self._run(lambda: self._rows("SELECT status, count(*) FROM batches GROUP BY status"))
        return dict(rows)

    # -- results --------------------------------------------------------------------------------------------
    async def record(self, batch_id: str, index: int, ok: bool, line: bytes) -> bool:
        return await self._run(lambda: self._db.execute(
            "INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)", (batch_id, index, int(ok), line)).rowcount > 0)

    async def results(self, batch_id: str) -> dict[int, tuple[bool, bytes]]:
        rows = await self._run(lambda: self._rows("SELECT idx, ok, line FROM results WHERE batch=?", batch_id))
        return {idx: (bool(ok), bytes(line)) for idx, ok, line in rows}

    async def counts(self, batch_id: str) -> tuple[int, int]:
        rows = await self._run(lambda: self._rows(
            "SELECT ok, count(*) FROM results WHERE batch=? GROUP BY ok", batch_id))
        by = dict(rows)
        return by.get(1, 0), by.get(0, 0)

    # -- leases ---------------------------------------------------------------------------------------------
    async def acquire(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        def work() -> bool:
            now = time.time()
            cursor = self._db.execute(
                "INSERT INTO leases VALUES (?, ?, ?) ON CONFLICT (batch) DO UPDATE SET owner=excluded.owner, "
                "until=excluded.until WHERE leases.owner=excluded.owner OR leases.until < ?",
                (batch_id, owner, now + ttl_s, now))
            return cursor.rowcount > 0

        return await self._run(work)

    async def release(self, batch_id: str, owner: str) -> None:
        await self._run(lambda: self._db.execute("DELETE FROM leases WHERE batch=? AND owner=?", (batch_id, owner)))

    async def close(self) -> None:
        await self._run(self._db.close)
        self._thread.shutdown(wait=True)


def _file_json(file: FileObject) -> dict[str, Any]:
    return {name: getattr(file, name) for name in FileObject.__slots__}
