"""Paged attention in plain torch: the reference every faster kernel is tested against.

Clarity beats speed here: one sequence at a time, its context gathered into contiguous K/V through its block
table, each KV head serving its group of query heads (SDPA ``enable_gqa``), and the softmax taken in fp32
whatever the cache dtype.

::

    kv_cache [2, num_blocks, block_size, kv_heads, head_dim]
               |        block_tables[i] = [7, 2, 5]          seq_len = 2 * block_size + 3
               v
    K_i = cat(kv_cache[0, 7], kv_cache[0, 2], kv_cache[0, 5])[:seq_len]     (only ceil(seq_len / bs) blocks)

That per-sequence loop (``_forward_per_sequence``) is the readable reference and serves a step's prefill
chunks. Its decodes (one query token each) take a batched path instead, in a pure-decode step and beside
prefill chunks alike, because on CPU the Python loop itself dominated decode: one SDPA call per sequence per
layer, about a thousand small calls per step for a 30-layer model at batch 32 (and a step that admitted one
request beside 32 decodes of ``tiny`` took 13 ms in the loop, 3.6 ms batched). The batched path gathers the
sequences' contexts into a padded ``[n, kv_heads, max_len, head_dim]`` tensor and makes one SDPA call per layer
for each group of sequences::

    slots[i, p] = block_tables[i, p // bs] * bs + p % bs        p < max_len   (padding: valid slots, masked)
    mask[i, p]  = p < seq_lens[i]                                boolean, True = attend (None: no padding)

A group is sequences of similar context length whose padded K/V fits ``GATHER_BUDGET_BYTES`` (usually one
group, the whole step): gathered in one piece, a large ragged batch of a real model's heads left the cache and
padded its short contexts to the longest. The groups, ``slots`` and ``mask`` depend only on the step, so they
are built once, on first use, and kept in ``meta.backend_cache`` for the remaining layers. A decode token is
the last position of its context, so the padding mask is the causal mask. Grouped-query heads use SDPA's ``enable_gqa`` rather than copying K/V.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import accumulate
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine.kernels.metadata import AttentionMetadata

# A decode group's padded K and V together stay under this (one sequence at least). Gathered in one piece, a
# large ragged batch left the cache: the decode attention of a step of SmolLM2-135M's heads (30 layers, one
# thread, Zen 4 EPYC, bench/decode_groups.py), 32 contexts of 100-503 tokens took 1,136 ms in one group, 255 ms
# under 4 MiB, 337 ms in the per-sequence loop; 64 of 50-1,000, 4,277 / 866 / 1,109 ms. No step it measured
# was slower under 4 MiB than in one group; smaller budgets split batches that fit the cache whole.
GATHER_BUDGET_BYTES = 4 << 20


class DecodeGroup(NamedTuple):
    """Sequences whose decodes share one padded SDPA call: ``rows`` (their query rows in the step; None: every
    sequence, in order), ``slots [n, max_len]`` (slots[i, p] = block_tables[i, p // bs] * bs + p % bs, padding
    included) and ``mask [n, 1, 1, max_len]`` (True = attend; None: no padding)."""

    rows: torch.Tensor | None
    slots: torch.Tensor
    mask: torch.Tensor | None

    @classmethod
    def of(cls, meta: AttentionMetadata, seqs: list[int] | None, block_size: int) -> DecodeGroup:
        """The group of the step's sequences ``seqs`` (None: all of them, in order, each one query token)."""
        device = meta.block_tables.device
        lens = meta.seq_lens_cpu if seqs is None else [meta.seq_lens_cpu[i] for i in seqs]
        rows = picked = None
        if seqs is not None:
            picked = torch.tensor(seqs, device=device)
            # A sequence's query row is its first token's in the step: itself when every sequence decodes.
            rows = picked if meta.max_query_len == 1 else meta.query_start_loc.index_select(0, picked).long()
        tables, seq_lens = (meta.block_tables, meta.seq_lens) if picked is None else (
            meta.block_tables.index_select(0, picked), meta.seq_lens.index_select(0, picked))
        max_len = max(lens)
        tables = tables[:, : -(-max_len // block_size)].long()
        offsets = torch.arange(block_size, device=device)
        slots = (tables[:, :, None] * block_size + offsets).flatten(1)[:, :max_len]
        # No padding when every context is max_len long (always so for one sequence): no mask at all.
        mask = None
        if min(lens) != max_len:
            positions = torch.arange(max_len, device=device)
            mask = (positions[None, :] < seq_lens[:, None].long())[:, None, None, :]
        return cls(rows, slots, mask)


class TorchAttentionBackend:
    """Stateless; one instance serves every layer."""

    name = "torch"
    # The per-sequence loop reads lengths on the host: a captured graph would replay one batch's lengths.
    supports_cuda_graphs = False
    stores_rotated = False

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Write ``key``/``value`` ``[T, kv_heads, head_dim]`` into ``kv_cache`` at ``slot_mapping[T]``.

        The flat views share storage with the cache (which is contiguous), so the copy lands in place.
        """
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        key_slots = kv_cache[0].view(-1, num_kv_heads, head_dim)
        value_slots = kv_cache[1].view(-1, num_kv_heads, head_dim)
        key_slots.index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        value_slots.index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Causal attention of ``query [T, heads, head_dim]`` over each sequence's cached context.

        The step's own K/V must already be stored (``store_kv``): a query token attends to itself through
        the cache. Returns ``[T, heads, head_dim]`` in the query's dtype.
        """
        if meta.max_query_len == 1 and query.shape[0] == meta.num_seqs:
            return self._forward_decode(query, kv_cache, meta, scale)
        output = torch.empty_like(query)
        lens = meta.query_lens_cpu
        decodes = [seq for seq, query_len in enumerate(lens) if query_len == 1]
        if len(decodes) > 1:  # beside prefill chunks, the decodes still go batched
            self._decode_into(output, query, kv_cache, meta, scale, decodes)
            self._attend_each(output, query, kv_cache, meta, scale, [seq for seq, n in enumerate(lens) if n != 1])
        else:
            self._attend_each(output, query, kv_cache, meta, scale, range(len(lens)))
        return output

    @staticmethod
    def _decode_groups(meta: AttentionMetadata, kv_cache: torch.Tensor,
                       decodes: list[int] | None = None) -> list[DecodeGroup]:
        """The step's ``decodes`` (None: every sequence, each one query token) in groups (see ``DecodeGroup``),
        built once per step: sequences by context length, each group as many as fit ``GATHER_BUDGET_BYTES``
        padded to its longest (one at least), so that a group's gathered K/V stays in cache and pads little.
        One group: every sequence, in order."""
        block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
        key = ("torch_decode", block_size)
        cached = meta.backend_cache.get(key)
        if cached is None:
            row_bytes = 2 * num_kv_heads * head_dim * kv_cache.element_size()  # a context position's K and V
            seqs = range(meta.num_seqs) if decodes is None else decodes
            lens = meta.seq_lens_cpu
            if len(seqs) * max(lens[seq] for seq in seqs) * row_bytes <= GATHER_BUDGET_BYTES:  # no sorting
                cached = [DecodeGroup.of(meta, decodes, block_size)]
            else:
                members: list[list[int]] = [[]]
                for seq in sorted(seqs, key=lens.__getitem__):  # the newest member is the longest
                    if members[-1] and (len(members[-1]) + 1) * lens[seq] * row_bytes > GATHER_BUDGET_BYTES:
                        members.append([])
                    members[-1].append(seq)
                cached = [DecodeGroup.of(meta, member, block_size) for member in members]
            meta.backend_cache[key] = cached
        return cached

    def _forward_decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """One query token per sequence: one padded, masked SDPA call per group of sequences."""
        groups = self._decode_groups(meta, kv_cache)
        if len(groups) == 1 and groups[0].rows is None:
            return self._attend(query, kv_cache, groups[0], scale)
        output = torch.empty_like(query)
        self._decode_into(output, query, kv_cache, meta, scale)
        return output

    def _decode_into(self, output: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float, decodes: list[int] | None = None) -> None:
        """Fill the ``output`` rows of the step's ``decodes`` (None: every sequence), group by group."""
        for group in self._decode_groups(meta, kv_cache, decodes):
            output.index_copy_(0, group.rows, self._attend(query.index_select(0, group.rows), kv_cache, group, scale))

    @staticmethod
    def _attend(query: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup, scale: float) -> torch.Tensor:
        """``query [num_seqs, heads, head_dim]``: the group's sequences' decode tokens, in its order."""
        num_kv_heads, head_dim = kv_cache.shape[3:]
        num_seqs, max_len = group.slots.shape
        # index_select on the flat slots, not advanced indexing with the 2-D ``slots``: the same rows, copied
        # 1.6-2x faster on CPU (SmolLM2 shapes, one layer: 1 x 256 tokens 192 -> 102 us, 32 x 128 tokens
        # 3.0 -> 1.9 ms). [num_seqs * max_seq_len, kv_heads, head_dim] -> [num_seqs, kv_heads, max_seq_len, D]
        flat = group.slots.reshape(-1)
        key = kv_cache[0].view(-1, num_kv_heads, head_dim).index_select(0, flat)
        value = kv_cache[1].view(-1, num_kv_heads, head_dim).index_select(0, flat)
        key = key.view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2).float()
        value = value.view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2).float()
        attended = F.scaled_dot_product_attention(
            query[:, :, None].float(), key, value, attn_mask=group.mask, scale=scale, enable_gqa=True
        )
        return attended[:, :, 0].to(query.dtype)

    def _forward_per_sequence(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """The reference: each sequence's context gathered through its block table, one SDPA call each."""
        output = torch.empty_like(query)
        self._attend_each(output, query, kv_cache, meta, scale, range(meta.num_seqs))
        return output

    @staticmethod
    def _attend_each(output: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, seqs: Iterable[int]) -> None:
        """Fill the ``output`` rows of the step's sequences ``seqs``, one SDPA call each."""
        block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
        query_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
        starts = list(accumulate(query_lens, initial=0))
        for seq in seqs:
            query_len, seq_len = query_lens[seq], seq_lens[seq]
            start = starts[seq]
            end = start + query_len
            num_blocks = -(-seq_len // block_size)
            blocks = meta.block_tables[seq, :num_blocks]
            key = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            value = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]

            # The step's queries are the last query_len positions of the context. A chunk that is the whole
            # context needs no mask (plain causal attention). Inputs are 4-D ([1, heads, T, D]): with 3-D ones
            # SDPA takes its math path on the CPU, not the fused (flash) kernel; at 1,000 tokens of SmolLM2
            # the math path was 88 ms a layer, the fused one 16 ms causal and 25 ms masked (one thread).
            visible = None
            if query_len != seq_len:
                query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
                key_pos = torch.arange(seq_len, device=query.device)
                visible = key_pos[None, :] <= query_pos[:, None]

            # KV head j serves query heads j*group .. j*group+group-1 (enable_gqa; no copy of K/V).
            attended = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1).float()[None],
                key.transpose(0, 1).float()[None],
                value.transpose(0, 1).float()[None],
                attn_mask=visible,
                is_causal=visible is None,
                scale=scale,
                enable_gqa=True,
            )[0]
            output[start:end] = attended.transpose(0, 1).to(query.dtype)
