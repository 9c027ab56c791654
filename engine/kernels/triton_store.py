"""Triton kernel that scatters a step's new K/V rows into the paged cache by ``slot_mapping``.

One program per new token copies that token's ``[kv_heads, head_dim]`` key and value rows into slot
``s = slot_mapping[t]``, i.e. block ``s // block_size``, offset ``s % block_size``::

    key[t]   ----------------->  kv_cache[0, s // block_size, s % block_size, :, :]
    value[t] ----------------->  kv_cache[1, s // block_size, s % block_size, :, :]

A negative slot means "no slot": the padding rows of a CUDA-graph batch carry ``-1`` and write nothing,
so a padded replay can never clobber a real sequence's cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_ptr,
    key_stride_t,
    key_stride_h,
    value_stride_t,
    value_stride_h,
    cache_stride_kv,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    # int64: block * stride overflows int32 once a layer's pool passes 2**31 elements.
    slot = slot.to(tl.int64)
    dst = (
        cache_ptr
        + (slot // BLOCK_SIZE) * cache_stride_block
        + (slot % BLOCK_SIZE) * cache_stride_slot
        + heads[:, None] * cache_stride_head
        + dims[None, :]
    )
    key = tl.load(key_ptr + token * key_stride_t + heads[:, None] * key_stride_h + dims[None, :], mask=mask)
    value = tl.load(
        value_ptr + token * value_stride_t + heads[:, None] * value_stride_h + dims[None, :], mask=mask
    )
    tl.store(dst, key.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + cache_stride_kv, value.to(cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` ``[T, kv_heads, head_dim]`` into ``kv_cache`` at ``slot_mapping[T]``.

    A negative slot skips its token. ``head_dim`` must be contiguous in every tensor (it is: projections,
    RoPE and the cache all produce it so); the other strides are free.
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    for name, tensor in (("key", key), ("value", value), ("kv_cache", kv_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(
                f"store_kv: {name} must have a contiguous head_dim, got strides {tensor.stride()}"
            )
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
