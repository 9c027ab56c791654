"""Paged attention in plain torch: the reference every faster kernel is tested against.

Clarity beats speed here: one sequence at a time, its context gathered into contiguous K/V through its block
table, grouped-query heads expanded, and the softmax taken in fp32 whatever the cache dtype.

::

    kv_cache [2, num_blocks, block_size, kv_heads, head_dim]
               |        block_tables[i] = [7, 2, 5]          seq_len = 2 * block_size + 3
               v
    K_i = cat(kv_cache[0, 7], kv_cache[0, 2], kv_cache[0, 5])[:seq_len]     (only ceil(seq_len / bs) blocks)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.metadata import AttentionMetadata


class TorchAttentionBackend:
    """Stateless; one instance serves every layer."""

    name = "torch"
    # The per-sequence loop reads lengths on the host: a captured graph would replay one batch's lengths.
    supports_cuda_graphs = False

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
        block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
        group = query.shape[1] // num_kv_heads
        output = torch.empty_like(query)
        start = 0
        for seq, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            end = start + query_len
            num_blocks = -(-seq_len // block_size)
            blocks = meta.block_tables[seq, :num_blocks]
            key = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            value = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len]
            # KV head j serves query heads j*group .. j*group+group-1.
            key = key.repeat_interleave(group, dim=1)
            value = value.repeat_interleave(group, dim=1)

            # The step's queries are the last query_len positions of the context.
            query_pos = torch.arange(seq_len - query_len, seq_len, device=query.device)
            key_pos = torch.arange(seq_len, device=query.device)
            visible = key_pos[None, :] <= query_pos[:, None]

            attended = F.scaled_dot_product_attention(
                query[start:end].transpose(0, 1).float(),
                key.transpose(0, 1).float(),
                value.transpose(0, 1).float(),
                attn_mask=visible,
                scale=scale,
            )
            output[start:end] = attended.transpose(0, 1).to(query.dtype)
            start = end
        return output
