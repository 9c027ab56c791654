"""A decode step of every decoder layer in one native call (engine/kernels/native/decode_step.c), where the
model allows it.

At one decoding token a SmolLM2 layer was ~50 small torch ops (views, RoPE, the K/V store, the attention
gather and softmax, residual adds, SiLU * up), each a few microseconds of dispatch: as long as the layer's
int4 matmuls, and no shorter with a second thread. ``NativeDecoder.run`` does what the layers' torch path
does (llama.py, with the torch attention backend) for a step in which every sequence decodes one token, in
one C call whose threads share each phase's work by claiming it (decode_step.c).

``decoder_for`` is asked once, when the model loads (native_path.bind), and says why where it does not
apply: the native library is off (engine/kernels/native/library.py), ``KVGUARD_NATIVE_DECODE=0``, a
projection is not a fused int4 ``Q4Linear`` without bias (weights.py; so a GGUF's 4-bit matrices under
``auto`` or ``int4``), the norms are not float32 on the CPU, a head is not a multiple of 16 wide, or the
attention backend is not the torch one (whose paged-cache semantics decode_step.c reproduces). Per step,
``applies`` asks that every sequence has exactly one new token and no LoRA adapter. Everything else takes
the torch path, which stays the reference: tests/engine/test_native_decode.py holds the two together.

The C side keeps raw pointers to the weights, taken after the loader applied the weight formats; the KV
caches' pointers are refreshed whenever the caches passed change. A deep copy of a model gets no decoder
(``__deepcopy__``): its weights live elsewhere, so it takes the torch path until it is bound itself.
"""

from __future__ import annotations

import ctypes
import os

import torch
from torch import nn

from engine.kernels.metadata import AttentionMetadata
from engine.kernels.native.layout import DecodeLayer, DecodeModel, Q4Weight
from engine.kernels.native.ops import NativeKernels
from engine.kernels.torch_ref import TorchAttentionBackend
from engine.model.lora_slots import NO_LORA
from engine.model.weights import Q4Linear


def _weight(linear: nn.Module) -> Q4Weight:
    return Q4Weight(linear.qpack.data_ptr(), linear.scales.data_ptr())


class NativeDecoder:
    """The C view of one ``DecoderStack`` (llama.py): its weights' pointers, laid out as decode_step.c's
    ``decode_model``."""

    def __init__(self, stack: nn.Module, library: NativeKernels) -> None:
        first = stack.layers[0]
        attention, mlp = first.self_attn, first.mlp
        self.library = library
        self.first_attention = attention
        self.layers = (DecodeLayer * len(stack.layers))()
        for entry, layer in zip(self.layers, stack.layers, strict=True):
            entry.input_norm = layer.input_layernorm.weight.data_ptr()
            entry.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            entry.qkv, entry.o = _weight(layer.self_attn.qkv_proj), _weight(layer.self_attn.o_proj)
            entry.gate_up, entry.down = _weight(layer.mlp.gate_up_proj), _weight(layer.mlp.down_proj)
        rotary = stack.rotary_emb
        self.model = DecodeModel(
            layers=len(stack.layers), hidden=attention.o_proj.out_features, heads=attention.num_heads,
            kv_heads=attention.num_kv_heads, head_dim=attention.head_dim, intermediate=mlp.intermediate_size,
            eps=first.input_layernorm.eps, scale=attention.head_dim**-0.5, cos=rotary.cos_cache.data_ptr(),
            sin=rotary.sin_cache.data_ptr(), layer=self.layers,
        )
        self._caches: tuple[int, ...] = ()

    def __deepcopy__(self, memo: dict) -> None:
        return None  # the module docstring: a copy's weights live elsewhere

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
        failed = self.library.c.decode_step(
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


def decoder_for(stack: nn.Module, library: NativeKernels | None) -> tuple[NativeDecoder | None, str]:
    """The native decoder of ``stack`` (a llama.py ``DecoderStack``) and why, or None and why not."""
    if library is None:
        return None, "off (the native library is off)"
    if os.environ.get("KVGUARD_NATIVE_DECODE", "1") == "0":
        return None, "off (KVGUARD_NATIVE_DECODE=0)"
    why_not = _unsupported(stack)
    return (None, f"off ({why_not})") if why_not else (NativeDecoder(stack, library), "on")


def _unsupported(stack: nn.Module) -> str | None:
    for layer in stack.layers:
        attention, mlp = layer.self_attn, layer.mlp
        projections = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(type(p) is Q4Linear and p.bias is None for p in projections):
            return "the projections are not all fused int4 without bias"
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if any(w.dtype != torch.float32 or w.is_cuda or not w.is_contiguous() for w in norms):
            return "the norms are not float32 on the CPU"
        if not isinstance(attention.attn_backend, TorchAttentionBackend):
            return "the attention backend is not the torch one"
        if attention.head_dim % 16:
            return "a head is not a multiple of 16 wide"
    norms = [n for layer in stack.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
    if len({n.eps for n in norms}) != 1 or stack.rotary_emb.cos_cache.dtype != torch.float32:
        return "the norms' epsilons differ or the RoPE tables are not float32"
    return None
