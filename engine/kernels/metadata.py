"""Per-step attention metadata, built once per step by the runner and shared by every layer.

Layout of one step's flattened batch (three sequences, the first two prefilling a chunk, the last decoding)::

    tokens:           | a0 a1 a2 | b0 b1 | c0 |
    query_start_loc:  0          3       5    6         (cu_seqlens_q, num_seqs + 1 entries)
    seq_lens:         [ctx_a,     ctx_b,  ctx_c]         (tokens in the KV cache after this step's store)

Query token ``j`` of sequence ``i`` sits at absolute position ``seq_lens[i] - query_len[i] + j`` and attends
to every cached position ``<= `` its own (causal over the cached prefix plus the new tokens).

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V);
slot ``s`` is ``(s // block_size, s % block_size)`` in that pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V is stored into
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, rows padded with 0 past the sequence's blocks
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    # Host copies so the torch reference and the runner never synchronise with the device to read them.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # Scratch a backend may fill on first use and reuse in every layer of the step (the torch backend keeps
    # its decode gather indices and padding mask here). Never an argument: ``dataclasses.replace`` drops it.
    backend_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def from_host(
        cls, slot_mapping: list[int], block_tables: list[list[int]], query_lens: list[int], seq_lens: list[int],
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build a step's metadata from host lists: pads block tables with 0, derives cu_seqlens and maxima."""
        width = max(len(t) for t in block_tables)
        query_start_loc = [0]
        for n in query_lens:
            query_start_loc.append(query_start_loc[-1] + n)
        return cls(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32,
                                      device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
