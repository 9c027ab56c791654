"""Whether the model fuses small ops on CUDA, where each kernel launch and its pass over the activations cost
more than the arithmetic: q/k/v and gate/up as one matrix each (``weights.concatenated``), and one Triton
kernel each for RMSNorm with its residual add (engine/kernels/triton_norm.py; every residual add of a layer
goes into a norm), RoPE with its table lookup (triton_rope.py; with the Triton attention backend, together
with the K/V store: triton_rope_store.py) and the MLP's silu(gate) * up (triton_silu.py). CPU runs keep HF's
separate ops, the reference the parity tests hold the engine to. ``KVGUARD_CUDA_FUSION=0`` keeps them on CUDA too, for a
side-by-side run.
"""

from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("KVGUARD_CUDA_FUSION", "1") != "0"


def applies(tensor: torch.Tensor) -> bool:
    return ENABLED and tensor.is_cuda
