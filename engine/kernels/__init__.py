"""Attention and KV-store kernels: the torch reference and the Triton kernels, behind one interface.

The Triton modules (``triton_*.py``) are imported only when that backend is chosen, so the engine runs where
the triton package is missing.
"""

from engine.kernels.backend import ATTENTION_BACKENDS, AttentionBackend, get_attention_backend
from engine.kernels.metadata import AttentionMetadata
from engine.kernels.torch_ref import TorchAttentionBackend

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "TorchAttentionBackend",
    "get_attention_backend",
]
