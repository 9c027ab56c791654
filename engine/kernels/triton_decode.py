"""Triton paged attention for decode rows (one query token per sequence), split over the context.

Decode reads every cached K/V byte once per step and does little maths on it, so the kernel is shaped for
bandwidth: each program loads one KV head's keys and values once and serves every query head of that GQA
group from them, and a long context is cut into ``num_splits`` independent pieces so that a small batch
still puts enough programs on the GPU to saturate memory.

Two launches, the second only with several splits::

    stage 1, grid (seqs, kv_heads, num_splits)          stage 2, grid (seqs, heads)
    +------------------------------------------+
    | context of seq i: | split 0 | split 1 |..|  -->  partial[i, h, s, :] (normalised), lse[i, h, s]
    +------------------------------------------+
                                                     out[i, h] = sum_s w_s * partial[i, h, s] / sum_s w_s,
                                                     w_s = 2 ** (lse[i, h, s] - max_s lse[i, h, s])

Split ``s`` of a sequence covers ``[s * L, min((s + 1) * L, seq_len))`` with ``L = max(min_split_keys,
ceil(seq_len / num_splits))`` rounded up to a multiple of ``block_n``: a fixed number of keys per program
(``MIN_SPLIT_KEYS``) until the context outgrows ``num_splits`` of them, so a short sequence is not cut into
pieces too small to pay for their partial results. Splits past the context are empty and skipped by both
stages, so a short sequence in a batch tuned for long ones costs no extra reads. A sequence that uses one
split has its output written by stage 1 itself (stage 2 passes over it), and with ``num_splits == 1`` there
is no stage 2 and no partial buffer at all: the large batches, which fill the GPU without splitting, pay for
no reduce. ``num_splits`` depends only on the batch shape, never on the contexts, and the kernels read every
per-step value (context lengths, block tables, query offsets) from device memory: both properties keep a
captured CUDA graph valid across replays.

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
# Keys per program before a context is cut into more splits: two 128-key tiles. A split's partial result
# (fp32, per query head) costs ~3% of the K/V it read at head_dim 64; smaller splits pay more and reduce more.
# Chosen, not yet timed (bench/kernel_bandwidth.py times the engine's launch).
MIN_SPLIT_KEYS = 256


def default_tile(head_dim: int) -> tuple[int, int]:
    """``(block_n, num_warps)``: keys per tile and warps per program of the engine's launch.

    Up to head_dim 64: 128 x 4, timed on an H200 (docs/benchmarks.md, "Engine on a GPU"): it beat the first
    choice, 64 x 8, in every cell at batch >= 64 (78% -> 94% of a device copy at batch 256, context 8192).
    Above: 64 x 8, since 128 x 4 spills registers at head_dim 128 on sm_90 (ptxas -v); not yet timed.
    """
    return (128, 4) if head_dim <= 64 else (64, 8)


@triton.jit
def _split_len(seq_len, min_split_keys, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tokens per split: at least ``min_split_keys``, and a whole number of tiles, so only a split's last tile
    is ragged."""
    return tl.cdiv(tl.maximum(tl.cdiv(seq_len, NUM_SPLITS), min_split_keys), BLOCK_N) * BLOCK_N


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
    out_ptr,
    scale_log2,
    min_split_keys,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
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
    split_len = _split_len(seq_len, min_split_keys, NUM_SPLITS, BLOCK_N)
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

    mask = row_ok[:, None] & dim_ok[None, :]
    # Two branches, not one `or`: NUM_SPLITS is a compile-time constant, and with one split the partial and
    # lse stores below must not be compiled at all (their buffers are one-element stand-ins then).
    if NUM_SPLITS == 1:  # noqa: SIM114 - the whole context in this program: the output, no reduce to follow
        _store_out(out_ptr, token, heads, dims, out_stride_t, out_stride_h, acc / total[:, None], mask)
    elif split_len >= seq_len:  # this sequence's only split: the reduce passes over it
        _store_out(out_ptr, token, heads, dims, out_stride_t, out_stride_h, acc / total[:, None], mask)
    else:
        out_rows = (
            seq.to(tl.int64) * partial_stride_seq + heads * partial_stride_head + split * partial_stride_split
        )
        tl.store(partial_ptr + out_rows[:, None] + dims[None, :], acc / total[:, None], mask=mask)
        tl.store(
            lse_ptr + seq.to(tl.int64) * lse_stride_seq + heads * lse_stride_head + split,
            best + tl.math.log2(total),
            mask=row_ok,
        )


@triton.jit
def _store_out(out_ptr, token, heads, dims, out_stride_t, out_stride_h, value, mask):
    """``value`` (fp32, ``[rows, dims]``) as the output rows of query heads ``heads`` of ``token``, rounded
    once to the output's dtype, as the reduce rounds its merged rows."""
    rows = token.to(tl.int64) * out_stride_t + heads * out_stride_h
    tl.store(out_ptr + rows[:, None] + dims[None, :], value.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_reduce_kernel(
    partial_ptr,
    lse_ptr,
    out_ptr,
    seq_lens_ptr,
    query_start_ptr,
    min_split_keys,
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
    num_used = tl.cdiv(seq_len, _split_len(seq_len, min_split_keys, NUM_SPLITS, BLOCK_N))
    if num_used == 1:  # stage 1 wrote this sequence's output itself
        return
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
    min_split_keys: int = MIN_SPLIT_KEYS,
) -> None:
    """Write into ``out`` the attention of every sequence whose query length is 1; other rows are untouched.

    ``query``/``out`` are ``[T, heads, head_dim]``; the cache, block tables, ``seq_lens`` and
    ``query_start_loc`` follow ``AttentionMetadata``. ``head_dim`` is contiguous in every tensor (other
    strides are free). ``num_splits`` and ``block_n`` are powers of two; ``block_n`` and ``num_warps`` are
    the tile a GPU sweep tries (bench/kernel_bandwidth.py ``--tiles``); None: ``default_tile``.
    ``min_split_keys``: the fewest keys a split covers (tests lower it to split their short contexts).
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
    # One split: the partial kernel writes ``out`` itself, and these stand-ins are never touched.
    shape = (num_seqs, num_heads, num_splits) if num_splits > 1 else (1, 1, 1)
    partial = torch.empty((*shape, head_dim), dtype=torch.float32, device=query.device)
    lse = torch.empty(shape, dtype=torch.float32, device=query.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    _decode_partial_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        partial,
        lse,
        out,
        scale * math.log2(math.e),
        min_split_keys,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
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
    if num_splits == 1:
        return
    _decode_reduce_kernel[(num_seqs, num_heads)](
        partial,
        lse,
        out,
        seq_lens,
        query_start_loc,
        min_split_keys,
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
