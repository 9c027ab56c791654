"""Block tables of sequences on top of the block pool: prefix hits, slot allocation, copy-on-write,
forks, swap and release.

Every block a sequence holds is referenced once by it; a block shared by a fork or a prefix hit has one
reference per holder. Only the last, partial block of a sequence is ever written, and a shared partial
block is copied before the write (copy-on-write). Full blocks are registered in the prefix cache only once
their KV has been computed (``commit``), so a hit never reads KV that is still to be written.

Invariants: a sequence has a device table (``tables``) or a host table (``host_tables``), never both; the
device tables hold exactly one reference per block entry (``BlockPool.check``), and the host tables hold
exactly the host ids the swap space has handed out (``SwapSpace.check``).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence

from engine.kv.block import KVBlock
from engine.kv.block_pool import BlockPool
from engine.kv.copies import BlockCopies
from engine.kv.hashing import extend_block_hashes
from engine.kv.sequence import KVSequence
from engine.kv.swap import SwapSpace

_NO_IDS = array("q")  # a sequence without device blocks (never modified)


class KVCacheManager:
    def __init__(self, pool: BlockPool, swap: SwapSpace, block_size: int) -> None:
        self.pool = pool
        self.swap = swap
        self.block_size = block_size
        self.tables: dict[int, list[KVBlock]] = {}  # seq_id -> device blocks, in token order
        # seq_id -> the ids of its table's blocks, rebuilt only when the table changes (once per block_size
        # decode steps), not for every step's chunk. Machine int64s (array 'q'): the worker packs every
        # table into the step's input buffer as bytes, with no conversion of Python ints per step.
        self._ids: dict[int, array] = {}
        self.host_tables: dict[int, list[int]] = {}  # seq_id -> host block ids while swapped out
        # seq_id -> leading entries of its device table already offered to the prefix cache, so that a
        # commit costs the blocks filled since the last one, not the whole table, every step.
        self._published: dict[int, int] = {}

    def block_ids(self, seq: KVSequence) -> array:
        """The ids of ``seq``'s device blocks, in token order (an ``array('q')``). Shared, never changed: read,
        do not modify."""
        return self._ids.get(seq.seq_id, _NO_IDS)

    def block_ids_of(self, seqs: list[KVSequence]) -> list[array]:
        """``block_ids`` of each of ``seqs``."""
        ids = self._ids
        return [ids.get(seq.seq_id, _NO_IDS) for seq in seqs]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: KVSequence) -> list[KVBlock]:
        """The longest run of this sequence's leading full blocks found in the prefix cache.

        The last token is never served from cache: its logits are needed to sample the next token.
        """
        if not self.pool.enable_prefix_caching:
            return []
        self._hash_full_blocks(seq)
        hits: list[KVBlock] = []
        for h in seq.block_hashes[: (len(seq.token_ids) - 1) // self.block_size]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(
        self, seq: KVSequence, num_new_tokens: int, copies: BlockCopies, cached: Sequence[KVBlock] = ()
    ) -> bool:
        """Give ``seq`` room for ``num_new_tokens`` more tokens, after adopting ``cached`` prefix blocks
        (whose tokens the caller then counts as computed).

        Returns False, changing nothing, when the pool cannot supply the blocks.
        """
        table = self.tables.get(seq.seq_id, [])
        if not cached and table and seq.num_computed_tokens + num_new_tokens <= len(table) * self.block_size and (
                seq.num_computed_tokens % self.block_size == 0 or table[-1].ref_count == 1):
            return True  # room in blocks it alone holds (most decodes): what follows would change nothing
        computed = seq.num_computed_tokens + len(cached) * self.block_size
        needed = self.blocks_needed(computed + num_new_tokens) - len(table) - len(cached)
        cow = None
        if computed % self.block_size and table and table[-1].ref_count > 1:
            cow = table[-1]
        # Cached hits that sit in the free queue stop being free when adopted.
        revived = sum(1 for b in cached if b.ref_count == 0)
        if max(needed, 0) + (cow is not None) + revived > self.pool.num_free:
            return False
        if cached:
            self.pool.touch(cached)
            table = table + list(cached)
        if cow is not None:
            (fresh,) = self.pool.allocate(1)
            copies.copy_on_write.append((cow.block_id, fresh.block_id))
            self.pool.free([cow])
            table[-1] = fresh
        if needed > 0:
            table = table + self.pool.allocate(needed)
        self._set_table(seq.seq_id, table)
        return True

    def commit(self, seq: KVSequence) -> None:
        """Publish the blocks that the computed tokens have filled to the prefix cache."""
        full = seq.num_computed_tokens // self.block_size
        published = self._published.get(seq.seq_id, 0)
        if not self.pool.enable_prefix_caching or full <= published:
            return
        self._hash_full_blocks(seq)
        table = self.tables[seq.seq_id]
        for i in range(published, full):
            self.pool.register(table[i], seq.block_hashes[i], seq.lora)
        self._published[seq.seq_id] = full

    def fork(self, parent: KVSequence, child: KVSequence) -> None:
        """Let ``child`` share every block of ``parent`` (copy-on-write on the partial last block)."""
        table = self.tables[parent.seq_id]
        self.pool.touch(table)
        self._set_table(child.seq_id, list(table))

    def free(self, seq: KVSequence) -> None:
        """Release every block and host block of ``seq``; tail blocks first so they are evicted first."""
        table = self._drop_table(seq.seq_id)
        self.pool.free(reversed(table))
        host = self.host_tables.pop(seq.seq_id, None)
        if host is not None:
            self.swap.free(host)

    def can_swap_out(self, seq: KVSequence) -> bool:
        return len(self.tables.get(seq.seq_id, [])) <= self.swap.num_free

    def swap_out(self, seq: KVSequence, copies: BlockCopies) -> None:
        table = self._drop_table(seq.seq_id)
        host = self.swap.allocate(len(table))
        copies.swap_out.extend(zip((b.block_id for b in table), host))
        self.host_tables[seq.seq_id] = host
        self.pool.free(reversed(table))

    def can_swap_in(self, seq: KVSequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq.num_computed_tokens + num_new_tokens) <= self.pool.num_free

    def swap_in(self, seq: KVSequence, num_new_tokens: int, copies: BlockCopies) -> None:
        """Bring ``seq`` back into fresh device blocks, with room for ``num_new_tokens`` more tokens."""
        host = self.host_tables.pop(seq.seq_id)
        restored = self.pool.allocate(len(host))
        copies.swap_in.extend(zip(host, (b.block_id for b in restored)))
        self.swap.free(host)
        self._set_table(seq.seq_id, restored)
        if not self.allocate(seq, num_new_tokens, copies):
            raise AssertionError("can_swap_in was checked")
        self.commit(seq)

    def check(self) -> None:
        """Raise ``RuntimeError`` unless the block tables agree with the pool (see ``BlockPool.check``) and
        the host tables with the swap space (see ``SwapSpace.check``), and no sequence holds both."""
        self.pool.check(Counter(block.block_id for table in self.tables.values() for block in table))
        self.swap.check([block_id for host in self.host_tables.values() for block_id in host])
        if both := self.tables.keys() & self.host_tables.keys():
            raise RuntimeError(f"sequences {sorted(both)} hold device and host blocks at once")
        if stale := self._published.keys() - self.tables.keys():
            raise RuntimeError(f"sequences {sorted(stale)} have published blocks but no device table")
        if {seq_id: ids.tolist() for seq_id, ids in self._ids.items()} != {
                seq_id: [b.block_id for b in table] for seq_id, table in self.tables.items()}:
            raise RuntimeError("the block id lists do not mirror the block tables")

    def _set_table(self, seq_id: int, table: list[KVBlock]) -> None:
        self.tables[seq_id] = table
        self._ids[seq_id] = array("q", [b.block_id for b in table])

    def _drop_table(self, seq_id: int) -> list[KVBlock]:
        self._published.pop(seq_id, None)
        self._ids.pop(seq_id, None)
        return self.tables.pop(seq_id, [])

    def _hash_full_blocks(self, seq: KVSequence) -> None:
        extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, seq.cache_salt, seq.lora)
