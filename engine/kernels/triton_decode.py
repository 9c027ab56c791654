"""Triton paged attention for decode rows (one query token per sequence), split over the context.

Decode reads every cached K/V byte once per step and does little maths on it, so the kernel is shaped for
bandwidth: each program loads one KV head's keys and values once and serves every query head of that GQA
group from them, and a long context is cut into ``num_splits`` independent pieces so that a small batch
still puts enough programs on the GPU to saturate memory.

Two launches::

    stage 1, grid (seqs, kv_heads, num_splits)          stage 2, grid (seqs, heads)
    +------------------------------------------+
    | context of seq i: | split 0 | split 1 |..|  -->  partial[i, h, s, :] (normalised), lse[i, h, s]
    +------------------------------------------+
                                                     out[i, h] = sum_s w_s * partial[i, h, s] / sum_s w_s,
                                                     w_s = 2 ** (lse[i, h, s] - max_s lse[i, h, s])

Split ``s`` of a sequence covers ``[s * L, min((s + 1) * L, seq_len))`` with ``L = ceil(seq_len /
num_splits)`` rounded up to a multiple of ``block_n``; splits past the context are empty and skipped by both
stages, so a short sequence in a batch tuned for long ones costs no extra reads. ``num_splits`` depends only
on the batch shape, never on the contexts, and the kernels read every per-step value (context lengths,
block tables, query offsets) from device memory: both properties keep a captured CUDA graph valid across
replays.

Rows whose query length is not 1 (prefill chunks in a mixed batch) are left untouched for the prefill
kernel. Logits are kept in base 2 (``scale * log2(e)`` folded in) so the exponentials are ``exp2``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.kernels.triton_softmax import paged_online_softmax

# Query heads of one KV head are padded to at least 16 rows: the smallest tile tensor cores take.
MIN_HEAD_ROWS = 16


def default_tile(head_dim: int) -> tuple[int, int]:
    """``(block_n, num_warps)``: keys per tile and warps per program of the engine's launch.

    Up to head_dim 64: 128 x 4, timed on an H200 (docs/benchmarks.md, "Engine on a GPU"): it beat the first
    choice, 64 x 8, in every cell at batch >= 64 (78% -> 94% of a device copy at batch 256, context 8192).
    Above: 64 x 8, since 128 x 4 spills registers at head_dim 128 on sm_90 (ptxas -v); not yet timed.
    """
    return (128, 4) if head_dim <= 64 else (64, 8)


@triton.jit
def _split_len(seq_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tokens per split: a whole number of tiles, so only a split's last tile is ragged."""
    return tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N


# A block table is as wide as the step's longest sequence needs, which changes from step to step: Triton
# would compile again whenever that width moves between 1, a multiple of 16 and neither.
@triton.jit(do_not_specialize=["table_stride"])
def _decode_partial_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    partial_ptr,
    lse_ptr,
    scale_log2,
    q_stride_t,
    q_stride_h,
    cache_stride_kv,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    table_stride,
    partial_stride_seq,
    partial_stride_head,
    partial_stride_split,
    lse_stride_seq,
    lse_stride_head,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_ptr + seq)
    if tl.load(query_start_ptr + seq + 1) - token != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = _split_len(seq_len, NUM_SPLITS, BLOCK_N)
    start = split * split_len
    if start >= seq_len:
        return
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    query = tl.load(
        q_ptr + token * q_stride_t + heads[:, None] * q_stride_h + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    ).to(cache_ptr.dtype.element_ty)

    table = block_tables_ptr + seq.to(tl.int64) * table_stride
    head_base = cache_ptr + kv_head * cache_stride_head
    acc, best, total = paged_online_softmax(
        query, table, head_base, start, end, None, scale_log2, cache_stride_kv, cache_stride_block,
        cache_stride_slot, BLOCK_H, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N, CAUSAL=False,
    )

    out_rows = (
        seq.to(tl.int64) * partial_stride_seq + heads * partial_stride_head + split * partial_stride_split
    )
    tl.store(
        partial_ptr + out_rows[:, None] + dims[None, :],
        acc / total[:, None],
        mask=row_ok[:, None] & dim_ok[None, :],
    )
    tl.store(
        lse_ptr + seq.to(tl.int64) * lse_stride_seq + heads * lse_stride_head + split,
        best + tl.math.log2(total),
        mask=row_ok,
    )


@triton.jit
def _decode_reduce_kernel(
    partial_ptr,
    lse_ptr,
    out_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_stride_t,
    out_stride_h,
    partial_stride_seq,
    partial_stride_head,
    partial_stride_split,
    lse_stride_seq,
    lse_stride_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_ptr + seq)
    if tl.load(query_start_ptr + seq + 1) - token != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_used = tl.cdiv(seq_len, _split_len(seq_len, NUM_SPLITS, BLOCK_N))
    splits = tl.arange(0, NUM_SPLITS)
    used = splits < num_used
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    lse = tl.load(
        lse_ptr + seq.to(tl.int64) * lse_stride_seq + head * lse_stride_head + splits,
        mask=used,
        other=float("-inf"),
    )
    weights = tl.math.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    rows = seq.to(tl.int64) * partial_stride_seq + head * partial_stride_head + splits * partial_stride_split
    partial = tl.load(
        partial_ptr + rows[:, None] + dims[None, :], mask=used[:, None] & dim_ok[None, :], other=0.0
    )
    merged = tl.sum(weights[:, None] * partial, 0) / tl.sum(weights, 0)
    tl.store(
        out_ptr + token.to(tl.int64) * out_stride_t + head * out_stride_h + dims,
        merged.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


def choose_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Smallest power-of-two split count that gives the GPU about two programs per SM.

    A function of the batch shape only, so every replay of a CUDA graph captured for a batch size agrees
    with the eager path on the same batch.
    """
    programs = num_seqs * num_kv_heads
    splits = 1
    while splits < max_splits and programs * splits < 2 * num_sms:
        splits *= 2
    return splits


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    num_splits: int,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Write into ``out`` the attention of every sequence whose query length is 1; other rows are untouched.

    ``query``/``out`` are ``[T, heads, head_dim]``; the cache, block tables, ``seq_lens`` and
    ``query_start_loc`` follow ``AttentionMetadata``. ``head_dim`` is contiguous in every tensor (other
    strides are free). ``num_splits`` and ``block_n`` are powers of two; ``block_n`` and ``num_warps`` are
    the tile a GPU sweep tries (bench/kernel_bandwidth.py ``--tiles``); None: ``default_tile``.
    """
    num_seqs = seq_lens.shape[0]
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    default_n, default_warps = default_tile(head_dim)
    block_n, num_warps = block_n or default_n, num_warps or default_warps
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    if num_splits & (num_splits - 1) or block_n & (block_n - 1):
        raise ValueError(
            f"decode_attention: num_splits ({num_splits}) and block_n ({block_n}) must be powers of 2"
        )
    partial = torch.empty(
        (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
    )
    lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        partial,
        lse,
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        GROUP=group,
        BLOCK_H=max(MIN_HEAD_ROWS, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        num_warps=num_warps,
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        partial,
        lse,
        out,
        seq_lens,
        query_start_loc,
        out.stride(0),
        out.stride(1),
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
    )
