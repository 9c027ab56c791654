"""One step's model inputs laid out on the host, from the scheduler's chunks, and their trip to the device.

Built once per step and shared by every layer (see ``AttentionMetadata`` for the layout). Token ``p`` of a
sequence is stored in slot ``table[p // block_size] * block_size + p % block_size`` of the KV pool.

``HostBatch.to_device`` packs every integer input into one int64 buffer, so a step costs one host-to-device
copy (from pinned memory, without waiting) instead of one synchronous copy per tensor; the inputs are views
of that one device buffer::

    | input_ids (T) | positions (T) | slot_mapping (T) | logits_indices (L) | query_start_loc (S+1) |
    | seq_lens (S) | block_tables (S * width, row-major) | pending_positions (P) | pending_rows (P) |

A token that the previous step sampled and nobody has read back yet (the scheduler ran ahead) is ``PENDING``
(-1) in ``input_ids``; ``pending_positions`` says where, ``pending_rows`` which of the previous step's
sampled tokens goes there, so the runner fills them in on the device.

The int32 inputs the kernels take (tables, lengths) are converted on the device.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from engine.kernels import AttentionMetadata
from engine.sched.output import SchedulerOutput


@dataclass(slots=True)
class HostBatch:
    """One step's inputs as host lists, in scheduling order (some of them the scheduler's own columns: read,
    do not modify)."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    block_tables: list[Sequence[int]]  # each sequence's blocks, as scheduled (to_device pads them with 0)
    query_lens: list[int]
    seq_lens: list[int]
    logits_indices: list[int]  # the last token of each chunk that samples
    pending_positions: list[int] = field(default_factory=list)  # where input_ids holds a PENDING token ...
    pending_rows: list[int] = field(default_factory=list)  # ... and the previous step's row that replaces it

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @classmethod
    def build(cls, out: SchedulerOutput, block_size: int) -> HostBatch:
        """The inputs of ``out``'s chunks; a step of decodes alone (most steps) takes its columns as they are."""
        starts, query_lens, tables = out.starts, out.num_new_tokens, out.block_tables
        ends = list(accumulate(query_lens))  # each chunk's last token is input row (its end - 1)
        if len(starts) == len(out.token_ids):  # one token a chunk: decodes (a one-token prompt is one too)
            positions = starts
            slots = [table[p // block_size] * block_size + p % block_size for table, p in zip(tables, starts)]
        else:
            positions, slots = [], []
            for table, start, num_new in zip(tables, starts, query_lens):
                span = range(start, start + num_new)
                positions += span
                slots += [table[p // block_size] * block_size + p % block_size for p in span]
        seq_lens = [start + num_new for start, num_new in zip(starts, query_lens)]
        logits_indices = [end - 1 for end, samples in zip(ends, out.num_samples) if samples]
        pending_positions: list[int] = []
        pending_rows: list[int] = []
        if out.pending_rows.count(-1) < len(out.pending_rows):  # some (run-ahead steps: all) are PENDING
            for end, pending in zip(ends, out.pending_rows):
                if pending >= 0:
                    pending_positions.append(end - 1)
                    pending_rows.append(pending)
        return cls(out.token_ids, positions, slots, tables, query_lens, seq_lens, logits_indices, pending_positions,
                   pending_rows)

    def to_device(self, device: torch.device) -> StepInputs:
        """The step's tensors on ``device``, all views of one buffer copied there once (see the module)."""
        num_tokens, num_seqs, num_logits = len(self.input_ids), self.num_seqs, len(self.logits_indices)
        width = max(map(len, self.block_tables))
        num_pending = len(self.pending_rows)
        # The short per-token and per-sequence lists become machine ints in one conversion (list += list runs
        # in C); the block tables, most of the buffer, are joined as the bytes of the KV manager's arrays,
        # each followed by its padding: converting them from Python ints was ~0.75 ms a step for 256 tables of
        # 40-63 blocks on the 2-core VM, joining them ~0.07 ms.
        flat = self.input_ids + self.positions + self.slot_mapping + self.logits_indices
        flat += accumulate(self.query_lens, initial=0)
        flat += self.seq_lens
        parts: list = [array("q", flat)]
        padding = bytes(8 * width)
        for table in self.block_tables:
            parts.append(table if type(table) is array else array("q", table))
            parts.append(padding[8 * len(table):])
        parts.append(array("q", self.pending_positions + self.pending_rows))
        host = torch.frombuffer(bytearray().join(parts), dtype=torch.int64)
        if device.type == "cuda":
            # Pinned, the copy need not wait for the host; the caching host allocator keeps the pinned block
            # until the copy has run.
            host = host.pin_memory().to(device, non_blocking=True)
        (input_ids, positions, slot_mapping, logits_indices, query_start_loc, seq_lens, tables, pending_positions,
         pending_rows) = host.split([num_tokens, num_tokens, num_tokens, num_logits, num_seqs + 1, num_seqs,
                                     num_seqs * width, num_pending, num_pending])
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=tables.view(num_seqs, width).to(torch.int32),
            query_start_loc=query_start_loc.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            query_lens_cpu=self.query_lens,
            seq_lens_cpu=self.seq_lens,
            max_query_len=self.max_query_len,
            max_seq_len=max(self.seq_lens),
        )
        pending = (pending_positions, pending_rows) if num_pending else None
        return StepInputs(input_ids, positions, logits_indices, meta, pending)


@dataclass(slots=True)
class StepInputs:
    """One step's inputs on the device: the model's arguments and the rows whose logits are wanted."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [L] int64: the last token of each chunk that samples
    meta: AttentionMetadata
    # Where input_ids holds PENDING tokens, and which rows of the previous step's tokens replace them ([P]
    # int64 each); None when there are none.
    pending: tuple[torch.Tensor, torch.Tensor] | None = None
