"""Triton kernel for a step's attention inputs in one pass: RoPE on its queries and keys, and the keys and
values scattered into the paged KV cache.

A fused q/k/v projection gives each token's heads side by side, ``[q_0 .. q_{H-1}, k_0 .. k_{K-1}, v_0 ..
v_{K-1}]``. Separately, ``rope`` (triton_rope.py) writes the rotated q and k heads to a new tensor and
``store_kv`` (triton_store.py) reads the keys back from it to scatter them: two launches, and the keys
written and read once more than needed. Here one program per token rotates its heads with the same maths
(``rotate_heads``), writes the queries to a new ``[T, H, D]`` tensor and the rotated keys and the values
straight into their cache slot, cast to the cache's dtype as ``store_kv`` casts them::

    query[t]            = rope(q heads of t)
    kv_cache[0, slot]   = rope(k heads of t)          slot = slot_mapping[t]: block slot // block_size,
    kv_cache[1, slot]   = v heads of t                                      offset slot % block_size

so the result is that of ``rope`` then ``store_kv``, rounding for rounding (a compiler may still contract
a multiply-add differently in the two: tests/engine/test_cuda_fusion.py compares them within the RoPE test's
tolerance; equal in Triton's interpreter). A negative slot (a CUDA-graph batch's padding row) writes nothing
to the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_rope import rotate_heads


@triton.jit
def _rope_store_kernel(
    heads_ptr,
    query_ptr,
    cache_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    slot_ptr,
    heads_stride_t,
    heads_stride_h,
    query_stride_t,
    query_stride_h,
    table_stride,
    cache_stride_kv,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_KV: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    cos_row = cos_ptr + position * table_stride
    sin_row = sin_ptr + position * table_stride
    dims = tl.arange(0, HEAD_DIM)[None, :]
    row = heads_ptr + token * heads_stride_t
    q_heads = tl.arange(0, BLOCK_Q)[:, None]
    q_mask = q_heads < NUM_HEADS
    query = rotate_heads(row + q_heads * heads_stride_h, q_mask, cos_row, sin_row, dims, HEAD_DIM)
    tl.store(query_ptr + token * query_stride_t + q_heads * query_stride_h + dims, query, mask=q_mask)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    kv_heads = tl.arange(0, BLOCK_KV)[:, None]
    kv_mask = kv_heads < NUM_KV_HEADS
    key = rotate_heads(row + (NUM_HEADS + kv_heads) * heads_stride_h, kv_mask, cos_row, sin_row, dims, HEAD_DIM)
    value = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + kv_heads) * heads_stride_h + dims, mask=kv_mask)
    # int64: block * stride overflows int32 once a layer's pool passes 2**31 elements (as in store_kv).
    slot = slot.to(tl.int64)
    dst = (cache_ptr + (slot // BLOCK_SIZE) * cache_stride_block + (slot % BLOCK_SIZE) * cache_stride_slot
           + kv_heads * cache_stride_head + dims)
    tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dst + cache_stride_kv, value.to(cache_ptr.dtype.element_ty), mask=kv_mask)


def rope_store_kv(heads: torch.Tensor, num_heads: int, positions: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The queries of ``heads [T, num_heads + 2 * kv_heads, D]`` (q, k and v heads side by side, D a power of
    two and contiguous) rotated by ``positions [T]`` with the fp32 tables ``cos`` and ``sin``, as a new
    ``[T, num_heads, D]`` tensor; the keys rotated and the values stored into ``kv_cache`` at
    ``slot_mapping [T]`` (see the module docstring)."""
    tokens, _, head_dim = heads.shape
    _, _, block_size, num_kv_heads, cache_dim = kv_cache.shape
    if heads.shape[1] != num_heads + 2 * num_kv_heads or cache_dim != head_dim:
        raise ValueError(f"rope_store_kv: heads {tuple(heads.shape)} are not {num_heads} query heads and "
                         f"{num_kv_heads} key and value heads of the cache's {cache_dim}")
    query = torch.empty((tokens, num_heads, head_dim), dtype=heads.dtype, device=heads.device)
    if tokens == 0:
        return query
    _rope_store_kernel[(tokens,)](
        heads, query, kv_cache, cos, sin, positions, slot_mapping,
        heads.stride(0), heads.stride(1), query.stride(0), query.stride(1), cos.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_Q=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads), num_warps=4,
    )
    return query
