"""Triton kernel for rotate-half RoPE: every head of a token turned by its position, in one pass.

llama.py's ``RotaryEmbedding.rotate`` computes ``x * cos + x.roll(D / 2) * sin_signed`` (``sin_signed`` is
``[-sin, sin]`` per half, so the roll is rotate-half): on a GPU that is four kernels a layer, plus the table
rows' gather and cast. Here one program per token reads its position's rows from the fp32 tables, casts
them to x's dtype as torch's ``.to`` does, and rounds each product and the sum as the separate ops do::

    out[t, h, i] = round(round(x[t, h, i] * cos[p, i]) + round(x[t, h, (i + D/2) mod D] * sin[p, i]))

with ``p = positions[t]``. ``x`` is ``[tokens, heads, D]`` with D a power of two, contiguous in D (a view
of a fused q/k/v output is fine); the result is a new contiguous tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rotate_heads(row, mask, cos_row, sin_row, dims, HEAD_DIM: tl.constexpr):
    """The heads at ``row`` (one pointer per head, ``[heads, 1]``; ``dims`` ``[1, HEAD_DIM]``) rotated by the
    table rows ``cos_row`` and ``sin_row``, rounded as the module docstring says, in the heads' dtype (the
    maths of ``rope``, shared with engine/kernels/triton_rope_store.py)."""
    x = tl.load(row + dims, mask=mask, other=0.0)
    rolled = tl.load(row + (dims + HEAD_DIM // 2) % HEAD_DIM, mask=mask, other=0.0)
    cos = tl.load(cos_row + dims).to(x.dtype).to(tl.float32)
    sin = tl.load(sin_row + dims).to(x.dtype).to(tl.float32)
    first = (x.to(tl.float32) * cos).to(x.dtype).to(tl.float32)
    second = (rolled.to(tl.float32) * sin).to(x.dtype).to(tl.float32)
    return (first + second).to(x.dtype)


@triton.jit
def _rope_kernel(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    x_stride_t,
    x_stride_h,
    out_stride_t,
    out_stride_h,
    table_stride,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = heads < num_heads
    rotated = rotate_heads(x_ptr + token * x_stride_t + heads * x_stride_h, mask, cos_ptr + position * table_stride,
                           sin_ptr + position * table_stride, dims, HEAD_DIM)
    tl.store(out_ptr + token * out_stride_t + heads * out_stride_h + dims, rotated, mask=mask)


def rope(heads: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``heads [T, n, D]`` rotated by ``positions [T]`` (int64) with the ``[max_positions, D]`` fp32 tables
    ``cos`` and ``sin`` (signed, see the module docstring)."""
    tokens, num_heads, head_dim = heads.shape
    out = torch.empty((tokens, num_heads, head_dim), dtype=heads.dtype, device=heads.device)
    if tokens == 0:
        return out
    _rope_kernel[(tokens,)](
        heads, out, cos, sin, positions,
        heads.stride(0), heads.stride(1), out.stride(0), out.stride(1), cos.stride(0), num_heads,
        HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_heads), num_warps=4,
    )
    return out
