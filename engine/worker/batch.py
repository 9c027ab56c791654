"""One step's model inputs laid out on the host, from the scheduler's chunks.

Built once per step and shared by every layer (see ``AttentionMetadata`` for the layout). Token ``p`` of a
sequence is stored in slot ``table[p // block_size] * block_size + p % block_size`` of the KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sched.output import ScheduledChunk


@dataclass(slots=True)
class HostBatch:
    """One step's inputs as host lists, in scheduling order."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[list[int]]  # padded with 0 to the longest table
    query_lens: list[int]
    seq_lens: list[int]
    logits_indices: list[int]  # the last token of each chunk that samples

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @classmethod
    def build(cls, chunks: list[ScheduledChunk], block_size: int) -> HostBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        for chunk in chunks:
            start, end = chunk.start, chunk.start + len(chunk.token_ids)
            table = chunk.block_table
            input_ids += chunk.token_ids
            positions += range(start, end)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
            tables.append(table)
            query_lens.append(end - start)
            seq_lens.append(end)
            if chunk.sample:
                logits_indices.append(len(input_ids) - 1)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return cls(input_ids, positions, slots, padded, query_lens, seq_lens, logits_indices)
