"""Invariants every test that drives the engine checks: block accounting, and nothing lost at the end."""

from __future__ import annotations

from collections import Counter

from engine.core import EngineCore
from engine.sched.request import SeqStatus


def check_block_accounting(core: EngineCore) -> None:
    pool, kv, sched = core.kv.pool, core.kv, core.scheduler
    holders = Counter(block.block_id for table in kv.tables.values() for block in table)
    for block in pool.blocks:
        assert block.ref_count == holders[block.block_id], f"block {block.block_id} refcount != holders"
    free_ids = {block.block_id for block in pool._free}
    assert free_ids == {b.block_id for b in pool.blocks if b.ref_count == 0}
    assert pool.num_cached == sum(1 for b in pool.blocks if b.ref_count == 0 and b.block_hash is not None)
    for h, block in pool._by_hash.items():
        assert block.block_hash == h
    running_ids = {s.seq_id for s in sched.running}
    assert set(kv.tables) == running_ids, "only running sequences hold device blocks"
    for seq in sched.running:
        assert len(kv.tables[seq.seq_id]) >= kv.blocks_needed(seq.num_computed_tokens)
        assert seq.status is SeqStatus.RUNNING
    for seq in sched.waiting:
        assert seq.num_computed_tokens == 0 and not seq.swapped_block_ids and seq.status is SeqStatus.WAITING
    host = [b for s in sched.swapped for b in s.swapped_block_ids]
    assert len(host) == len(set(host)) == kv.swap.num_used


def assert_all_blocks_back(core: EngineCore) -> None:
    """Nothing is lost: once no request is live, every device and host block is reclaimable."""
    snap = core.telemetry()
    assert not core.requests
    assert snap.free_blocks == snap.num_blocks, snap
    assert snap.swap_used_blocks == 0
    assert snap.num_running == snap.num_waiting == snap.num_swapped == 0
    assert all(block.ref_count == 0 for block in core.kv.pool.blocks)
    assert not core.kv.tables
