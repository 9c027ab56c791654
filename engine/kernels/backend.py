"""The attention backend interface and the choice of implementation.

Every backend does the same two things per layer and per step: scatter the step's new K/V into the paged
cache, then attend each query token to its sequence's cached context. The model calls only these two
methods, so the Triton kernels and the torch reference are interchangeable and testable against each other.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from engine.kernels.metadata import AttentionMetadata
from engine.kernels.torch_ref import TorchAttentionBackend

ATTENTION_BACKENDS = ("auto", "torch", "triton")


class AttentionBackend(Protocol):
    # True when a decode-only step's launches depend on nothing but the batch size (every per-step value is
    # read from device memory), so a CUDA graph captured once stays valid for every replay.
    supports_cuda_graphs: bool
    # True when the backend's cache is the layout and slot rule of engine/kernels/triton_store.py, so that the
    # model may store a fused projection's keys and values with RoPE in one kernel (triton_rope_store.py).
    stores_rotated: bool

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None: ...

    def forward(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor: ...


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend called ``name`` (the engine's ``attention_backend`` option) for ``device``.

    ``auto`` is Triton on CUDA (the torch reference when Triton is missing there) and the torch reference
    everywhere else. ``triton`` off CUDA runs the kernels in Triton's interpreter, which must be switched on
    with ``TRITON_INTERPRET=1`` before the kernels are first imported; it is slow and meant for tests.
    """
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention_backend: unknown backend {name!r}; "
            f"expected one of {', '.join(map(repr, ATTENTION_BACKENDS))}"
        )
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"attention_backend: 'triton' on {device.type} runs only in Triton's interpreter; "
            "set TRITON_INTERPRET=1 (slow, for tests) or use 'torch'"
        )
    try:
        from engine.kernels.triton_backend import TritonAttentionBackend
    except ImportError as error:
        if name == "auto":
            return TorchAttentionBackend()
        message = f"attention_backend: 'triton' needs the triton package, which failed to import: {error}"
        raise ValueError(message) from error
    return TritonAttentionBackend()
