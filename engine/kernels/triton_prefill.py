"""Triton paged attention for prefill chunks: new tokens attend causally to the cached prefix and to
each other, all read through the block table (the step's own K/V are stored before the kernel runs).

Grid ``(seqs, ceil(max_query_len / block_q), kv_heads)``. A program takes ``block_q`` consecutive query
tokens of one sequence and the ``group`` query heads that share one KV head, packed token-major into the
rows of a single tile, so each K/V tile it loads feeds every head of the group::

    rows of the query tile (group = 2, block_q = 3):   t0.h0  t0.h1  t1.h0  t1.h1  t2.h0  t2.h1
    key positions scanned:  0 .. context_start + last query token of the tile   (nothing beyond it is visible)

Query token ``j`` sits at absolute position ``seq_len - query_len + j`` and sees keys ``<=`` that position.
Padding rows (tokens past the chunk, heads past the group) are given positions past the context, so they
see every key and never hit an all-masked row; they are simply not stored. Sequences with a single query
token belong to the decode kernel and are skipped here.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.kernels.triton_softmax import paged_online_softmax

NUM_WARPS = 8


def default_tiles(head_dim: int, element_size: int) -> tuple[int, int]:
    """``(block_m, block_n)``: query rows (tokens x heads of a group) per program, keys per tile.

    16-bit caches up to head_dim 64: 128 x 64, timed on an H200 at 1.6-2.1x the TFLOP/s of 64 x 64
    (docs/benchmarks.md, "Engine on a GPU"). Above head_dim 64: 64 x 32, and 32 x 32 for fp32, the largest tiles
    ptxas compiles for sm_90 at ``NUM_WARPS`` without register spills (not yet timed).
    """
    if element_size > 2:
        return 32, 32
    return (128, 64) if head_dim <= 64 else (64, 32)


# A block table is as wide as the step's longest sequence needs, which changes from step to step: Triton
# would compile again whenever that width moves between 1, a multiple of 16 and neither.
@triton.jit(do_not_specialize=["table_stride"])
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,
    scale_log2,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    cache_stride_kv,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    table_stride,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_Q
    kv_head = tl.program_id(2)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    if query_len == 1 or first >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = seq_len - query_len

    rows = tl.arange(0, BLOCK_Q * BLOCK_G)
    token = first + rows // BLOCK_G
    group_row = rows % BLOCK_G
    heads = kv_head * GROUP + group_row
    row_ok = (token < query_len) & (group_row < GROUP)
    query_pos = context_start + token
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    io_mask = row_ok[:, None] & dim_ok[None, :]
    q_rows = (query_start + token).to(tl.int64) * q_stride_t + heads * q_stride_h
    query = tl.load(q_ptr + q_rows[:, None] + dims[None, :], mask=io_mask, other=0.0)
    query = query.to(cache_ptr.dtype.element_ty)

    table = block_tables_ptr + seq.to(tl.int64) * table_stride
    head_base = cache_ptr + kv_head * cache_stride_head
    last = tl.minimum(context_start + first + BLOCK_Q, seq_len)
    acc, _, total = paged_online_softmax(
        query, table, head_base, 0, last, query_pos, scale_log2, cache_stride_kv, cache_stride_block,
        cache_stride_slot, BLOCK_Q * BLOCK_G, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, CAUSAL=True,
    )

    out_rows = (query_start + token).to(tl.int64) * out_stride_t + heads * out_stride_h
    tl.store(
        out_ptr + out_rows[:, None] + dims[None, :],
        (acc / total[:, None]).to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    max_query_len: int,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int = NUM_WARPS,
) -> None:
    """Write into ``out`` the attention of every sequence whose query length exceeds 1; others untouched.

    Layouts as in ``decode_attention`` (``head_dim`` contiguous). ``block_m`` (query rows per program) and
    ``block_n`` (keys per tile) are powers of two, by default ``default_tiles``; a program takes
    ``block_m // group`` tokens (at least one) of a sequence. Tiles and ``num_warps`` other than the defaults
    are for a GPU sweep (bench/prefill_tiles.py).
    """
    num_seqs = seq_lens.shape[0]
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    default_m, default_n = default_tiles(head_dim, kv_cache.element_size())
    block_m = block_m or default_m
    block_n = block_n or default_n
    group = query.shape[1] // num_kv_heads
    block_g = triton.next_power_of_2(group)
    block_q = max(1, block_m // block_g)
    if block_m & (block_m - 1) or block_n & (block_n - 1):
        raise ValueError(
            f"prefill_attention: block_m ({block_m}) and block_n ({block_n}) must be powers of 2"
        )
    _prefill_kernel[(num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)](
        query,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_G=block_g,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        num_warps=num_warps,
    )
