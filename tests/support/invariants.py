"""Invariants every test that drives the engine checks: block accounting, and nothing lost at the end."""

from __future__ import annotations

from engine.core import EngineCore
from engine.sched.request import SeqStatus


def check_block_accounting(core: EngineCore) -> None:
    kv, sched = core.kv, core.scheduler
    kv.check()
    running_ids = {s.seq_id for s in sched.running}
    assert set(kv.tables) == running_ids, "only running sequences hold device blocks"
    assert set(kv.host_tables) == {s.seq_id for s in sched.swapped}, "only swapped sequences hold host blocks"
    for seq in sched.running:
        assert len(kv.tables[seq.seq_id]) >= kv.blocks_needed(seq.num_computed_tokens)
        assert seq.status is SeqStatus.RUNNING
    for seq in sched.waiting:
        assert seq.num_computed_tokens == 0 and seq.seq_id not in kv.host_tables and seq.status is SeqStatus.WAITING


def assert_all_blocks_back(core: EngineCore) -> None:
    """Nothing is lost: once no request is live, every device and host block is reclaimable."""
    snap = core.telemetry()
    assert not core.requests
    assert snap.used_blocks == 0, snap  # every device block is free or cached
    assert snap.swap_used_blocks == 0
    assert snap.num_running == snap.num_waiting == snap.num_swapped == 0
    assert not core.kv.tables and not core.kv.host_tables
    core.kv.check()  # with no table left, every ref count is 0 and every block is in the free queue
