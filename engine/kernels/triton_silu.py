"""Triton kernel for the MLP's gate: ``silu(gate) * up`` in one pass instead of two kernels.

Rounded as the separate ops round: ``round(round(silu(gate)) * up)`` in the inputs' dtype, silu computed in
fp32 as ``g / (1 + exp(-g))``. ``gate`` and ``up`` are ``[tokens, intermediate]``, contiguous in their last
dimension (the two halves of a fused gate/up output are fine); the result is a new contiguous tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, gate_stride, up_stride, out_stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    activated = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (activated * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    rows, cols = gate.shape
    out = torch.empty((rows, cols), dtype=gate.dtype, device=gate.device)
    if rows == 0:
        return out
    _silu_mul_kernel[(rows, triton.cdiv(cols, BLOCK))](
        gate, up, out, gate.stride(0), up.stride(0), out.stride(0), cols, BLOCK=BLOCK, num_warps=4
    )
    return out
