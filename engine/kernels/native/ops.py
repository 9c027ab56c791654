"""``NativeKernels``: one loaded build of the native library (library.py) with its kernels on torch
tensors. Each method checks nothing the caller has checked (``q4.fits``, ``int8_fits``); tensors are float32
(the inputs are made so), contiguous, on the CPU. A model's modules hold the instance chosen when it loaded;
copying a model shares it (a library is loaded once per process)."""

from __future__ import annotations

import ctypes

import torch

from engine.kernels.native.q4 import TILE

# int8_matmul.c takes up to 8 rows, but pays off only at one: SmolLM2's LM head (49152 x 576), against
# torch's weight-only kernel on bfloat16 activations, best of 20 on the 2-core Xeon (AVX-512 VNNI): one row
# 4.11 vs 4.94 ms at one thread, 2.33 vs 2.46 at two (both read the 28 MB at memory speed), 4 rows 8.76 vs
# 7.02 and 11.7 vs 10.0 ms (a float reduction per row and output). Its error against the exact product:
# 2e-5 of the largest output, torch's 5e-3.
INT8_ROWS = 1


def int8_fits(rows: int, in_features: int) -> bool:
    """Whether ``int8_matmul`` takes this product: one row, inputs a multiple of 64 up to 1024."""
    return rows <= INT8_ROWS and in_features % 64 == 0 and in_features <= 1024


class NativeKernels:
    """The C functions of one build (``target``: library.TARGETS' name)."""

    def __init__(self, target: str, library: ctypes.CDLL) -> None:
        self.target = target
        self.c = library

    def __copy__(self) -> NativeKernels:
        return self

    def __deepcopy__(self, memo: dict) -> NativeKernels:
        return self

    def __repr__(self) -> str:
        return f"NativeKernels({self.target!r})"

    def q4_matmul(self, x: torch.Tensor, qpack: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``x [M, K] @ W^T`` in float32, W as ``q4.pack`` lays it."""
        x = x.float().contiguous()
        rows, k = x.shape
        out = torch.empty(rows, qpack.shape[0] * TILE, dtype=torch.float32)
        if self.c.q4_matmul(x.data_ptr(), rows, k, qpack.data_ptr(), scales.data_ptr(), out.shape[1],
                            out.data_ptr()):
            raise MemoryError("q4_matmul: could not allocate its scratch memory")
        return out

    def int8_matmul(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``(x [M, K] @ qweight^T) * scales`` in float32 (``qweight`` int8 ``[N, K]``, ``scales`` float32
        ``[N]``, both contiguous; ``int8_fits(M, K)``)."""
        x = x.float().contiguous()
        rows, k = x.shape
        out = torch.empty(rows, qweight.shape[0], dtype=torch.float32)
        if self.c.int8_matmul(x.data_ptr(), rows, k, qweight.data_ptr(), scales.data_ptr(), qweight.shape[0],
                              out.data_ptr()):
            raise MemoryError("int8_matmul: could not allocate its scratch memory")
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension (``x`` float32, contiguous)."""
        out = torch.empty_like(x)
        k = x.shape[-1]
        self.c.rms_norm(x.data_ptr(), weight.data_ptr(), eps, x.numel() // k, k, out.data_ptr())
        return out
