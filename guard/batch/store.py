"""What a batch store keeps, and which one a guard's config gets.

Both stores (sqlite_store.py, embedded; redis_store.py, with ``shared_state``) keep the same things with
the same guarantees, which the runner (runner.py) relies on:

- ``record`` keeps a line's result only if none is kept for that line yet, and says whether it kept it: a
  line counts as done exactly when its result is recorded, so two guards that both ran it (one that lost
  its lease and one that took over) leave one result, and a line is never answered twice;
- ``acquire`` takes or renews a batch's lease for ``owner`` for ``ttl_s`` seconds, and fails while another
  owner holds it: one guard runs a batch at a time, and a guard that dies loses its batches when its lease
  lapses;
- ``cancel`` sets ``cancelling_at`` apart from the rest of the batch, which ``save_batch`` never touches, so a
  cancel cannot be lost to a runner saving the batch in the same instant;
- lookups take the tenant: another tenant's file or batch is not found.
"""

from __future__ import annotations

from typing import Protocol

from guard.batch.objects import BatchObject, FileObject
from guard.config import GuardConfig


class BatchStore(Protocol):
    async def add_file(self, file: FileObject, content: bytes) -> None: ...
    async def file(self, tenant: str, file_id: str) -> FileObject | None: ...
    async def files(self, tenant: str) -> list[FileObject]: ...  # newest first
    async def content(self, file_id: str) -> bytes | None: ...
    async def delete_file(self, tenant: str, file_id: str) -> bool: ...
    async def add_batch(self, batch: BatchObject) -> None: ...
    async def batch(self, tenant: str | None, batch_id: str) -> BatchObject | None: ...  # None: any tenant's
    async def batches(self, tenant: str) -> list[BatchObject]: ...  # newest first
    async def save_batch(self, batch: BatchObject) -> None: ...
    async def cancel(self, batch_id: str, at: int) -> None: ...
    async def open_batches(self) -> list[BatchObject]: ...
    async def record(self, batch_id: str, index: int, ok: bool, line: bytes) -> bool: ...
    async def results(self, batch_id: str) -> dict[int, tuple[bool, bytes]]: ...
    async def counts(self, batch_id: str) -> tuple[int, int]: ...  # (completed, failed)
    async def statuses(self) -> dict[str, int]: ...  # batches by status
    async def acquire(self, batch_id: str, owner: str, ttl_s: float) -> bool: ...
    async def release(self, batch_id: str, owner: str) -> None: ...
    async def close(self) -> None: ...


def open_store(config: GuardConfig) -> BatchStore:
    """Redis with ``shared_state``, so that every guard sees every batch; else the embedded store."""
    assert config.batch is not None
    if config.shared_state is not None:
        from guard.batch.redis_store import RedisBatchStore

        return RedisBatchStore(config.shared_state.redis_url)
    from guard.batch.sqlite_store import SqliteBatchStore

    return SqliteBatchStore(config.batch.store)
