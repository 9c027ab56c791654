"""Triton kernel for RMSNorm, optionally after a residual add, in one pass over each row.

In 16-bit, llama.py's RMSNorm is HF's sequence of ops (upcast, square, mean, rsqrt, scale, downcast, weight)
and the residual add before it one more: about nine kernels per norm, two norms a layer. On a GPU each is a
launch and a pass over the activations, and at decode they dominate: in the first profile of a Qwen2.5-0.5B
decode step on an H200 (docs/benchmarks.md, "Engine on a GPU") elementwise, copy and reduction kernels were
~45% of the device time. One program per row does it all here, with HF's rounding::

    sum    = round(x + residual)                       (what ``x + residual`` gives in x's dtype)
    y      = round(sum * rsqrt(mean(sum^2) + eps))     (normalised in fp32, cast back before the weight)
    out    = round(weight * y)

so ``sum`` equals torch's add bit for bit and ``out`` differs from the unfused ops only by the order of the
mean's fp32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    sum_ptr,
    x_stride,
    residual_stride,
    out_stride,
    sum_stride,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * sum_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    inverse = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    normed = (x32 * inverse).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(x.dtype), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(RMSNorm(x + residual), x + residual)`` for ``x`` and ``residual`` ``[rows, hidden]`` (rows contiguous
    in their last dimension) and ``weight [hidden]`` of x's dtype; the sum is None without ``residual``."""
    rows, hidden = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else None
    _rms_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        total if total is not None else out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        total.stride(0) if total is not None else 0,
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(hidden),
        num_warps=4 if hidden <= 2048 else 8,
    )
    return out, total
