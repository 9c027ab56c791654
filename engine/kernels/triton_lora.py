"""Triton kernels of the batched LoRA delta on the GPU (BGMV: each token gathers its own adapter's slot).

For a token ``t`` whose adapter sits in slot ``s = token_slots[t]`` (``-1``: the base model, nothing added)::

    shrink:  y[t, :]   = scales[s] * A[s] @ x[t, :]          A: [slots, R, in]     one program per token
    expand:  out[t, n] = base[t, n] + y[t, :] @ B[s, :, n]   B: [slots, R, out]    one program per token and
                                                                                   BLOCK_N outputs

The torch path (engine/model/lora_slots.py, ``lora_segmented``) computes the same sum with one matmul per
step for all adapters; the tests run both on the same inputs (this one in Triton's interpreter on CPU).
Accumulation is fp32 whatever the activations' dtype. ``R`` (the slots' rank, ``--max-lora-rank``) is padded
to a power of two inside the kernel by masking.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, scales_ptr, y_ptr, IN, R, x_stride, a_stride_s, a_stride_r,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    ranks = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        for start in range(0, IN, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + token * x_stride + cols, mask=cols < IN, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * a_stride_s + ranks[:, None] * a_stride_r + cols[None, :],
                        mask=(ranks[:, None] < R) & (cols[None, :] < IN), other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        acc = acc * tl.load(scales_ptr + slot)
    tl.store(y_ptr + token * BLOCK_R + ranks, acc)


@triton.jit
def _expand_kernel(y_ptr, b_ptr, slots_ptr, base_ptr, out_ptr, OUT, R, b_stride_s, b_stride_r, base_stride,
                   out_stride, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slots_ptr + token)
    result = tl.load(base_ptr + token * base_stride + cols, mask=cols < OUT, other=0.0)
    if slot >= 0:
        ranks = tl.arange(0, BLOCK_R)
        y = tl.load(y_ptr + token * BLOCK_R + ranks)
        b = tl.load(b_ptr + slot * b_stride_s + ranks[:, None] * b_stride_r + cols[None, :],
                    mask=(ranks[:, None] < R) & (cols[None, :] < OUT), other=0.0).to(tl.float32)
        result = (result.to(tl.float32) + tl.sum(y[:, None] * b, axis=0)).to(result.dtype)
    tl.store(out_ptr + token * out_stride + cols, result, mask=cols < OUT)


def lora_bgmv(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
              scales: torch.Tensor) -> torch.Tensor:
    """``out + delta`` (a new tensor) for ``x [T, in]``, ``a [slots, R, in]``, ``b [slots, R, out]``,
    ``token_slots [T]`` int32 and ``scales [slots]`` float32 (see the module)."""
    num_tokens, fan_in = x.shape
    rank, fan_out = b.shape[1], b.shape[2]
    x, a, b, out = x.contiguous(), a.contiguous(), b.contiguous(), out.contiguous()
    block_r = triton.next_power_of_2(rank)
    y = torch.empty((num_tokens, block_r), dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_tokens,)](x, a, token_slots, scales, y, fan_in, rank, x.stride(0), a.stride(0),
                                  a.stride(1), BLOCK_R=block_r, BLOCK_K=64)
    result = torch.empty_like(out)
    block_n = 64
    _expand_kernel[(num_tokens, triton.cdiv(fan_out, block_n))](
        y, b, token_slots, out, result, fan_out, rank, b.stride(0), b.stride(1), out.stride(0), result.stride(0),
        BLOCK_R=block_r, BLOCK_N=block_n)
    return result
