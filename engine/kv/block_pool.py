"""The pool of KV blocks: allocation, reference counts and the prefix cache index.

A block is *used* while some sequence references it, *free* otherwise. A free block that still holds a
full, hashed prefix is also *cached*: a later request with the same prefix (and salt) takes it back out of
the free queue instead of recomputing it; otherwise it is evicted when the queue hands it out again.
So ``num_free`` counts every reclaimable block, cached ones included, and ``num_used + num_free`` is
always ``num_blocks``.

Which hashes the index holds can be followed as events (engine/kv/events.py): once ``record_events`` is
called, every hash that enters the index (``register``) or leaves it (an eviction) is appended to the log it
returns, which its caller drains once per step. Only a caller that drains asks for one, so the offline
``LLM`` records nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from engine.kv.block import FreeBlockQueue, KVBlock
from engine.kv.events import KVEventLog


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks: must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free = FreeBlockQueue(self.blocks)
        self._by_hash: dict[bytes, KVBlock] = {}
        self._num_cached_free = 0
        self.evictions_total = 0
        self.events: KVEventLog | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return self._num_cached_free

    def record_events(self) -> KVEventLog:
        """Start logging the hashes that enter and leave the index; the caller must drain the log (once per step).

        The log starts with the hashes already indexed as stored, so that its batches, applied in order to an
        empty set, always give the index.
        """
        self.events = KVEventLog(stored=list(self._by_hash))
        return self.events

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._by_hash.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue (least recently used first), evicting prefixes."""
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        taken = []
        for _ in range(n):
            block = self._free.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to blocks found in the prefix cache (or shared by a fork)."""
        for block in blocks:
            if block.ref_count == 0:
                self._free.remove(block)
                if block.block_hash is not None:
                    self._num_cached_free -= 1
            block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free queue's tail in order.

        Callers pass a sequence's blocks in reverse, so that its last (leaf) blocks are evicted before the
        prefix blocks that other requests are more likely to share.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"KV block {block.block_id} freed more often than referenced")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free.append(block)
                if block.block_hash is not None:
                    self._num_cached_free += 1

    def register(self, block: KVBlock, block_hash: bytes, lora: str | None = None) -> None:
        """Publish a full, computed block under its prefix hash (first writer wins; duplicates stay private);
        ``lora`` names the adapter that computed it, for the event log."""
        if not self.enable_prefix_caching or block.block_hash is not None or block_hash in self._by_hash:
            return
        block.block_hash = block_hash
        self._by_hash[block_hash] = block
        if self.events is not None:
            self.events.stored.append(block_hash)
            if lora is not None:
                self.events.adapters[block_hash] = lora

    def check(self, holders: Counter[int]) -> None:
        """Raise ``RuntimeError`` unless the pool is consistent with ``holders`` (block id -> how many block
        tables hold it): every ref count equals its holders, the free queue is exactly the unreferenced
        blocks, and the hash index and the cached count match the blocks. O(num_blocks): for tests and checks
        of an idle engine, not for the step loop."""
        problems = [f"block {b.block_id}: ref_count {b.ref_count}, held by {holders[b.block_id]}"
                    for b in self.blocks if b.ref_count != holders[b.block_id]]
        queued = [b.block_id for b in self._free]
        unreferenced = [b.block_id for b in self.blocks if b.ref_count == 0]
        if len(queued) != len(set(queued)) or set(queued) != set(unreferenced):
            problems.append(f"free queue {sorted(queued)} != unreferenced blocks {unreferenced}")
        problems += [f"hash index maps to block {b.block_id}, which has another hash"
                     for h, b in self._by_hash.items() if b.block_hash != h]
        hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        if hashed != len(self._by_hash):
            problems.append(f"{hashed} blocks carry a hash, the index holds {len(self._by_hash)}")
        cached = sum(1 for b in self.blocks if b.ref_count == 0 and b.block_hash is not None)
        if cached != self._num_cached_free:
            problems.append(f"num_cached {self._num_cached_free} != {cached} free blocks with a hash")
        if problems:
            raise RuntimeError("KV block pool inconsistent: " + "; ".join(problems))

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self._by_hash[block.block_hash]
        if self.events is not None:
            self.events.removed.append(block.block_hash)
        block.block_hash = None
        self._num_cached_free -= 1
        self.evictions_total += 1
