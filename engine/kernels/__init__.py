"""Attention and KV-store kernels: the torch reference and (later) Triton, behind one interface."""

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
