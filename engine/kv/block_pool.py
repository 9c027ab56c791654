"""The pool of KV blocks: allocation, reference counts and the prefix cache index.

A block is *used* while some sequence references it, *free* otherwise. A free block that still holds a
full, hashed prefix is also *cached*: a later request with the same prefix (and salt) takes it back out of
the free queue instead of recomputing it; otherwise it is evicted when the queue hands it out again.
So ``num_free`` counts every reclaimable block, cached ones included, and ``num_used + num_free`` is
always ``num_blocks``.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.kv.block import FreeBlockQueue, KVBlock


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

    def register(self, block: KVBlock, block_hash: bytes) -> None:
        """Publish a full, computed block under its prefix hash (first writer wins; duplicates stay private)."""
        if not self.enable_prefix_caching or block.block_hash is not None or block_hash in self._by_hash:
            return
        block.block_hash = block_hash
        self._by_hash[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self._by_hash.values():
            block.block_hash = None
        self._by_hash.clear()
        self._num_cached_free = 0

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self._by_hash[block.block_hash]
        block.block_hash = None
        self._num_cached_free -= 1
        self.evictions_total += 1
