"""The attention backend interface and the choice of implementation.

Every backend does the same two things per layer and per step: scatter the step's new K/V into the paged
cache, then attend each query token to its sequence's cached context. The model calls only these two
methods, so the Triton kernels and the torch reference are interchangeable and testable against each other.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.kernels.metadata import AttentionMetadata
from engine.kernels.torch_ref import TorchAttentionBackend

ATTENTION_BACKENDS = ("auto", "torch", "triton")


class AttentionBackend(Protocol):
    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None: ...

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor: ...


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called ``name`` (the engine's ``attention_backend`` option) for ``device``.

    ``auto`` is the torch reference on every device until the Triton kernels land; it will then pick
    Triton on CUDA.
    """
    if name in ("auto", "torch"):
        return TorchAttentionBackend()
    if name == "triton":
        raise ValueError("attention_backend: 'triton' kernels are not available yet; use 'torch' or 'auto'")
    raise ValueError(
        f"attention_backend: unknown backend {name!r}; expected one of {', '.join(map(repr, ATTENTION_BACKENDS))}"
    )
