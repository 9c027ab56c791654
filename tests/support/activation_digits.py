"""Error bounds of the native kernels' two-digit activations (engine/kernels/native/kernels.h), for tests
that hold a quantized product to an error analysis instead of one machine's figure.

The kernels write each input ``x[r, k]`` as two int8 digits on its group's step: the high digit on
``d = max|x[r, g]| / 127`` (g: the 32 inputs of k's group), the low digit on ``d / 254``. The low digit takes
what the high one's rounding left (at most d / 2, so within its 127 steps), and rounds it to nearest: each
input is represented within half a low step, ``max|x[r, g]| / (2 * 127 * 254)``."""

from __future__ import annotations

import torch

GROUP = 32
LOW_STEPS = 127 * 254  # low-digit steps per unit of the group's largest input


def low_step(x: torch.Tensor) -> torch.Tensor:
    """Each input's low-digit step ``[rows, K]``: its group's largest magnitude over 127 * 254."""
    rows, k = x.shape
    largest = x.abs().reshape(rows, k // GROUP, GROUP).amax(dim=-1, keepdim=True)
    return largest.expand(rows, k // GROUP, GROUP).reshape(rows, k) / LOW_STEPS


def product_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[rows, N]``: how far the kernel's ``x @ weight^T`` may be from the exact product of ``x`` and the
    weights it holds: half a low step per input, weighted by ``|W|``, plus float32 rounding of the sums
    (K roundings of at most 2^-24 of the running sum of ``|x| |W|``, each group's integer sum exact)."""
    x, weight = x.double(), weight.double()
    quantization = (low_step(x) / 2) @ weight.abs().T
    rounding = x.shape[1] * 2.0**-24 * (x.abs() @ weight.abs().T)
    return (quantization + rounding).float()
