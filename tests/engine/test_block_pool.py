"""Block pool, free queue and prefix hashing: the invariants the rest of the engine relies on."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.kv.block import FreeBlockQueue, KVBlock
from engine.kv.block_pool import BlockPool
from engine.kv.hashing import block_hash, extend_block_hashes, root_hash


def test_free_queue_is_fifo_and_removes_from_the_middle() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    assert queue.popleft().block_id == 0
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 4, 2]
    assert len(queue) == 4


@given(st.lists(st.tuples(st.sampled_from(["pop", "push", "remove"]), st.integers(0, 7)), max_size=60))
def test_free_queue_matches_a_list_model(ops: list[tuple[str, int]]) -> None:
    blocks = [KVBlock(i) for i in range(8)]
    queue = FreeBlockQueue(blocks)
    model = list(range(8))
    for op, i in ops:
        if op == "pop" and model:
            assert queue.popleft().block_id == model.pop(0)
        elif op == "push" and i not in model:
            queue.append(blocks[i])
            model.append(i)
        elif op == "remove" and i in model:
            queue.remove(blocks[i])
            model.remove(i)
        assert [b.block_id for b in queue] == model and len(queue) == len(model)


def test_allocate_takes_least_recently_freed_and_evicts_its_hash() -> None:
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    assert pool.num_free == 0 and pool.num_used == 4
    pool.register(a, b"h-a")
    pool.free([d, c, b, a])  # a sequence frees tail first
    assert pool.num_cached == 1 and pool.num_free == 4
    first, second, third = pool.allocate(3)
    assert (first, second, third) == (d, c, b), "leaf blocks are reused before the shared prefix"
    assert pool.lookup(b"h-a") is a
    (fourth,) = pool.allocate(1)
    assert fourth is a and pool.lookup(b"h-a") is None and pool.evictions_total == 1
    assert a.block_hash is None and pool.num_cached == 0


def test_touch_revives_a_cached_block_and_refcounts_share_it() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.register(block, b"h")
    pool.free([block])
    assert pool.num_cached == 1
    pool.touch([block])
    pool.touch([block])
    assert block.ref_count == 2 and pool.num_free == 1 and pool.num_cached == 0
    pool.free([block])
    assert pool.num_free == 1
    pool.free([block])
    assert pool.num_free == 2 and pool.num_cached == 1
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([block])


def test_first_registration_wins_and_disabled_cache_registers_nothing() -> None:
    pool = BlockPool(3)
    a, b, _ = pool.allocate(3)
    pool.register(a, b"h")
    pool.register(b, b"h")
    assert pool.lookup(b"h") is a and b.block_hash is None
    off = BlockPool(1, enable_prefix_caching=False)
    (block,) = off.allocate(1)
    off.register(block, b"h")
    assert off.lookup(b"h") is None


def test_allocating_more_than_free_changes_nothing() -> None:
    pool = BlockPool(2)
    with pytest.raises(MemoryError):
        pool.allocate(3)
    assert pool.num_free == 2


def test_hash_chain_covers_the_whole_prefix_and_the_salt() -> None:
    tokens = list(range(10))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens, 4, "tenant-a")
    assert len(hashes) == 2, "only full blocks are hashed"
    assert hashes[1] == block_hash(block_hash(root_hash("tenant-a"), tokens[:4]), tokens[4:8])
    other_salt: list[bytes] = []
    extend_block_hashes(other_salt, tokens, 4, "tenant-b")
    assert not set(hashes) & set(other_salt), "different salts never share a block hash"
    changed_first = [99] + tokens[1:]
    diverged: list[bytes] = []
    extend_block_hashes(diverged, changed_first, 4, "tenant-a")
    assert diverged[1] != hashes[1], "a block's hash depends on everything before it"
    extend_block_hashes(hashes, tokens + [10, 11], 4, "tenant-a")
    assert len(hashes) == 3


def test_check_names_what_is_inconsistent() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.check(Counter({a.block_id: 1, b.block_id: 1}))
    with pytest.raises(RuntimeError, match=f"block {b.block_id}: ref_count 1, held by 0"):
        pool.check(Counter({a.block_id: 1}))
    b.ref_count = 0  # corrupted behind the pool's back: unreferenced, but not in the free queue
    with pytest.raises(RuntimeError, match="free queue"):
        pool.check(Counter({a.block_id: 1}))
