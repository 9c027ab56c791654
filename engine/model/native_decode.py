"""A decode step of every decoder layer in one native call (decode_step.c), where the model allows it.

At one decoding token a SmolLM2 layer was ~50 small torch ops (views, RoPE, the K/V store, the attention
gather and softmax, residual adds, SiLU * up), each a few microseconds of dispatch: as long as the layer's
int4 matmuls, and no shorter with a second thread. ``NativeDecoder.run`` does what the layers' torch path
does (llama.py, with the torch attention backend) for a step in which every sequence decodes one token, in
one C call whose threads share each phase's work by claiming it (decode_step.c).

It applies (``decoder_for``) when the native library is built (q4_native: ``KVGUARD_Q4_NATIVE=0`` turns
both off; ``KVGUARD_NATIVE_DECODE=0`` this alone), every layer's projections are fused int4 ``Q4Linear``
(weights.py; so a GGUF's 4-bit matrices under ``auto`` or ``int4``) without bias, the norms and activations
are float32 on the CPU, the heads are a multiple of 16 wide, and the attention backend is the torch one (whose
paged-cache semantics decode_step.c reproduces); and per step (``applies``) when every sequence has exactly
one new token and no LoRA adapter is attached. Everything else takes the torch path, which stays the
reference: tests/engine/test_native_decode.py holds the two together.

The C side keeps raw pointers to the weights: a decoder is built on a model's first decode step (after the
loader applied the weight formats) and kept beside the model, not in it (``copy.deepcopy`` of a model never
copies pointers into the original); the KV caches' pointers are refreshed whenever the caches passed change.
"""

from __future__ import annotations

import ctypes
import os
import weakref

import torch
from torch import nn

# Not `from engine.model import ...`: that imports engine/model/__init__ (the loader), a circle.
import engine.model.q4_native as q4_native  # noqa: PLR0402
from engine.kernels.metadata import AttentionMetadata
from engine.kernels.torch_ref import TorchAttentionBackend
from engine.model.lora_slots import NO_LORA
from engine.model.weights import Q4Linear

_P = ctypes.c_void_p


class _Weight(ctypes.Structure):
    _fields_ = [("q", _P), ("s", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight),
                ("down", _Weight), ("kv_cache", _P)]


class _Model(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int), ("hidden", ctypes.c_int), ("heads", ctypes.c_int),
                ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int), ("intermediate", ctypes.c_int),
                ("block_size", ctypes.c_int), ("cache_slots", ctypes.c_int64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("cos", _P), ("sin", _P), ("layer", ctypes.POINTER(_Layer))]


def _weight(linear: nn.Module) -> _Weight:
    return _Weight(linear.qpack.data_ptr(), linear.scales.data_ptr())


class NativeDecoder:
    """The C view of one ``DecoderStack`` (llama.py): its weights' pointers, laid out as decode_step.c's
    ``decode_model``."""

    def __init__(self, stack: nn.Module) -> None:
        first = stack.layers[0]
        attention, mlp = first.self_attn, first.mlp
        # Not the stack itself: _decoders holds this weakly keyed by it, and the value must not keep it alive.
        self.first_attention = attention
        self.layers = (_Layer * len(stack.layers))()
        for entry, layer in zip(self.layers, stack.layers, strict=True):
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            entry.qkv, entry.o = _weight(layer.self_attn.qkv_proj), _weight(layer.self_attn.o_proj)
            entry.gate_up, entry.down = _weight(layer.mlp.gate_up_proj), _weight(layer.mlp.down_proj)
        rotary = stack.rotary_emb
        self.model = _Model(
            layers=len(stack.layers), hidden=attention.o_proj.out_features, heads=attention.num_heads,
            kv_heads=attention.num_kv_heads, head_dim=attention.head_dim, intermediate=mlp.intermediate_size,
            eps=first.input_layernorm.eps, scale=attention.head_dim**-0.5, cos=rotary.cos_cache.data_ptr(),
            sin=rotary.sin_cache.data_ptr(), layer=self.layers,
        )
        self._caches: tuple[int, ...] = ()

    def applies(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> bool:
        """Whether this step is one the native call does: one new token per sequence, float32, no adapter."""
        return (meta.max_query_len == 1 and positions.dtype == torch.int64 and hidden.shape[0] == meta.num_seqs
                and hidden.dtype == torch.float32 and not hidden.is_cuda and kv_caches[0].dtype == torch.float32
                and self.first_attention.lora is NO_LORA)

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            meta: AttentionMetadata) -> torch.Tensor:
        """Every layer on ``hidden [S, hidden]`` (the embeddings; overwritten in place, and returned), storing
        each token's K/V at ``meta.slot_mapping``: the caller has checked ``applies``."""
        self._point_at(kv_caches)
        hidden = hidden.contiguous()
        tables = meta.block_tables.contiguous()
        seq_lens = meta.seq_lens.contiguous()
        positions, slots = positions.contiguous(), meta.slot_mapping.contiguous()
        failed = q4_native._library().decode_step(
            ctypes.byref(self.model), hidden.data_ptr(), hidden.shape[0], positions.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), tables.shape[1], seq_lens.data_ptr())
        if failed:
            raise MemoryError("decode_step: could not allocate its scratch memory")
        return hidden

    def _point_at(self, kv_caches: list[torch.Tensor]) -> None:
        pointers = tuple(cache.data_ptr() for cache in kv_caches)
        if pointers != self._caches:
            for entry, cache in zip(self.layers, kv_caches, strict=True):
                if not cache.is_contiguous():
                    raise ValueError("decode_step: the KV caches must be contiguous")
                entry.kv_cache = cache.data_ptr()
            self.model.block_size = kv_caches[0].shape[2]
            self.model.cache_slots = kv_caches[0].shape[1] * kv_caches[0].shape[2]
            self._caches = pointers


_decoders: weakref.WeakKeyDictionary[nn.Module, NativeDecoder | None] = weakref.WeakKeyDictionary()


def decoder_for(stack: nn.Module) -> NativeDecoder | None:
    """The native decoder of ``stack`` (a llama.py ``DecoderStack``), built on first use; None where it does
    not apply (the module docstring)."""
    try:
        return _decoders[stack]
    except KeyError:
        decoder = _decoders[stack] = NativeDecoder(stack) if _supported(stack) else None
        return decoder


def _supported(stack: nn.Module) -> bool:
    if os.environ.get("KVGUARD_NATIVE_DECODE", "1") == "0" or not q4_native.available():
        return False
    for layer in stack.layers:
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(type(p) is Q4Linear and p.bias is None for p in projections):
            return False
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != torch.float32 or w.is_cuda or not w.is_contiguous() for w in norms):
            return False
        if not isinstance(attention.attn_backend, TorchAttentionBackend) or attention.head_dim % 16:
            return False
    norms = [n for layer in stack.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    return len({n.eps for n in norms}) == 1 and stack.rotary_emb.cos_cache.dtype == torch.float32
