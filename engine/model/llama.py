"""The Llama/Qwen2-family decoder, reading and writing its KV through the paged cache.

Module and parameter names mirror the Hugging Face checkpoints (``model.layers.3.self_attn.q_proj.weight``),
so loading is a 1:1 name match with no renaming table. The maths follows HF's eager implementation step for
step (RMSNorm in fp32, rotate-half RoPE, softmax in fp32), which is what keeps our logits within 1e-4 of it.

Tokens arrive flattened: ``input_ids [T]`` holds every sequence's new tokens of this step back to back, and
``AttentionMetadata`` says which tokens belong to which sequence. Nothing here depends on the batch layout.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.backend import AttentionBackend
from engine.kernels.metadata import AttentionMetadata
from engine.kernels.native.ops import NativeKernels
from engine.model import cuda_fusion
from engine.model.config import LinearRopeScaling, Llama3RopeScaling, ModelConfig, RopeScaling
from engine.model.lora_slots import NO_LORA
from engine.model.weights import concatenated, project

if TYPE_CHECKING:
    from engine.model.native_decode import NativeDecoder


class RMSNorm(nn.Module):
    # The native kernels, where native_path.bind found them when the model loaded: the same maths in one call.
    native: NativeKernels | None = None

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fuses(x):
            from engine.kernels.triton_norm import rms_norm  # deferred: triton may be missing on a CPU host

            return rms_norm(x, self.weight, self.eps)[0]
        if x.dtype == torch.float32:
            if self.native is not None and x.is_contiguous():
                return self.native.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and cast back before the weight, as HF does: bf16 models were trained that way.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + residual, self(x + residual))``; on CUDA in one kernel (engine/kernels/triton_norm.py)."""
        if self._fuses(x) and residual.stride(-1) == 1:
            from engine.kernels.triton_norm import rms_norm  # deferred, as in forward

            normed, total = rms_norm(x, self.weight, self.eps, residual)
            assert total is not None
            return total, normed
        total = x + residual
        return total, self(total)

    @staticmethod
    def _fuses(x: torch.Tensor) -> bool:
        """Whether the Triton kernel takes ``x``: on CUDA (``cuda_fusion``), rows contiguous in the last dim."""
        return cuda_fusion.applies(x) and x.dim() == 2 and x.stride(-1) == 1


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a cos/sin table precomputed for every position up to the model's maximum.

    ``rotate_half(x) * sin`` is computed as ``x.roll(D / 2) * sin_signed`` with ``sin_signed = [-sin, sin]``
    per half: the same products, bit for bit (negating is exact), in two ops where ``chunk``, ``neg``,
    ``cat`` and a multiply took four; and ``rotate`` turns the query and key heads at once when they lie side
    by side (a fused q/k/v projection), so a decode step pays these ops once a layer instead of twice.

    The table is built in fp32 on the host, even when the module is built on the meta device (the loader's
    fast path), and travels with ``.to(device)``; it is cast to the activations' dtype per use, as HF casts
    its freshly computed cos/sin. Positions must be below ``max_position_embeddings``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = _inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device="cpu")
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [max_pos, head_dim]: both halves share a frequency
        self.register_buffer("cos_cache", angles.cos(), persistent=False)
        half = config.head_dim // 2
        self.register_buffer("sin_cache", torch.cat((-angles[:, :half].sin(), angles[:, half:].sin()), dim=-1),
                             persistent=False)  # sin_signed (above)
        # Every layer of a forward passes the same ``positions`` tensor: its rows are gathered once, by the
        # first layer. ``start_forward`` forgets the last forward's rows, so that a CUDA graph captured from a
        # forward records that gather too (a graph's warm-up forward runs on the very same positions tensor).
        self._step: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def start_forward(self) -> None:
        self._step = None

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query [T, heads, D]`` and ``key [T, kv_heads, D]`` by their tokens' positions."""
        return self.rotate(positions, query), self.rotate(positions, key)

    def rotate_and_store(self, positions: torch.Tensor, heads: torch.Tensor, num_heads: int,
                         backend: AttentionBackend, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
                         ) -> torch.Tensor:
        """The queries of ``heads [T, num_heads + 2 * kv_heads, D]`` (a fused projection's q, k and v heads side
        by side) rotated; their keys rotated and their values stored in ``kv_cache`` at ``slot_mapping`` by
        ``backend``. On CUDA with the Triton backend in one kernel (engine/kernels/triton_rope_store.py),
        where rotating and storing take two and a tensor between them."""
        if backend.stores_rotated and self._fuses(heads):
            from engine.kernels.triton_rope_store import rope_store_kv  # deferred, as in rotate

            return rope_store_kv(heads, num_heads, positions, self.cos_cache, self.sin_cache, kv_cache, slot_mapping)
        num_kv_heads = (heads.shape[1] - num_heads) // 2
        query_key = self.rotate(positions, heads[:, : num_heads + num_kv_heads])
        query, key = query_key.split((num_heads, num_kv_heads), dim=1)
        backend.store_kv(key, heads[:, num_heads + num_kv_heads :], kv_cache, slot_mapping)
        return query

    def rotate(self, positions: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
        """Rotate ``heads [T, any number of heads, D]`` by their tokens' positions."""
        if self._fuses(heads):
            from engine.kernels.triton_rope import rope  # deferred: triton may be missing on a CPU host

            return rope(heads, positions, self.cos_cache, self.sin_cache)
        step = self._step
        if step is None or step[0] is not positions or step[1] != heads.dtype:
            cos = self.cos_cache[positions].to(heads.dtype)[:, None, :]
            sin = self.sin_cache[positions].to(heads.dtype)[:, None, :]
            step = self._step = (positions, heads.dtype, cos, sin)
        _, _, cos, sin = step
        return heads * cos + heads.roll(heads.shape[-1] // 2, dims=-1) * sin

    @staticmethod
    def _fuses(heads: torch.Tensor) -> bool:
        """Whether the Triton kernels take ``heads``: on CUDA (``cuda_fusion``), D contiguous and a power of two."""
        head_dim = heads.shape[-1]
        return cuda_fusion.applies(heads) and heads.stride(-1) == 1 and head_dim & (head_dim - 1) == 0


def _inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearRopeScaling):
        return inv_freq / scaling.factor
    return _llama3_scaled(inv_freq, scaling)


def _llama3_scaled(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Keep short wavelengths, stretch long ones by ``factor``, blend linearly in 1/wavelength between."""
    original_context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    long_wavelength = original_context / scaling.low_freq_factor
    short_wavelength = original_context / scaling.high_freq_factor
    blend = (original_context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq
    scaled = torch.where(wavelength > long_wavelength, inv_freq / scaling.factor, blended)
    return torch.where(wavelength < short_wavelength, inv_freq, scaled)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.layer_index = layer_index
        self.attn_backend = attn_backend
        hidden = config.hidden_size
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=config.attention_output_bias)
        self.lora = NO_LORA  # adds each token's adapter delta (engine/model/lora_slots.py attaches it)
        # q, k and v as one matrix when their weight format allows (fuse_projections): one matmul call, not
        # three, at every step of every layer; q_proj, k_proj and v_proj are gone then.
        self.qkv_proj: nn.Module | None = None
        self.qkv_sizes = (q_size, kv_size, kv_size)

    def fuse_projections(self) -> None:
        fused = concatenated([self.q_proj, self.k_proj, self.v_proj])
        if fused is not None:
            del self.q_proj, self.k_proj, self.v_proj
            self.qkv_proj = fused

    def _projections(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is not None:
            return self.qkv_proj(hidden).split(self.qkv_sizes, dim=-1)
        return self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        kv_cache = kv_caches[self.layer_index]
        if self.qkv_proj is not None and self.lora is NO_LORA:
            # The heads of q, k and v side by side: q and k rotate in one pass, k and v stored with it on CUDA.
            heads = self.qkv_proj(hidden).view(num_tokens, -1, self.head_dim)
            query = rotary.rotate_and_store(positions, heads, self.num_heads, self.attn_backend, kv_cache,
                                            meta.slot_mapping)
        else:
            query, key, value = self._projections(hidden)
            query = self.lora("q_proj", hidden, query).view(num_tokens, self.num_heads, self.head_dim)
            key = self.lora("k_proj", hidden, key).view(num_tokens, self.num_kv_heads, self.head_dim)
            value = self.lora("v_proj", hidden, value).view(num_tokens, self.num_kv_heads, self.head_dim)
            query, key = rotary(positions, query, key)
            self.attn_backend.store_kv(key, value, kv_cache, meta.slot_mapping)
        attended = self.attn_backend.forward(query, kv_cache, meta, scale=self.head_dim**-0.5)
        attended = attended.reshape(num_tokens, self.num_heads * self.head_dim)
        return self.lora("o_proj", attended, self.o_proj(attended))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.lora = NO_LORA  # as Attention's
        self.gate_up_proj: nn.Module | None = None  # as Attention's qkv_proj: gate and up in one matrix
        self.intermediate_size = config.intermediate_size

    def fuse_projections(self) -> None:
        fused = concatenated([self.gate_proj, self.up_proj])
        if fused is not None:
            del self.gate_proj, self.up_proj
            self.gate_up_proj = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        gate, up = self.lora("gate_proj", x, gate), self.lora("up_proj", x, up)
        if cuda_fusion.applies(gate) and gate.stride(-1) == 1 and up.stride(-1) == 1:
            from engine.kernels.triton_silu import silu_mul  # deferred: triton may be missing on a CPU host

            gated = silu_mul(gate, up)
        else:
            gated = F.silu(gate) * up
        return self.lora("down_proj", gated, self.down_proj(gated))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index, attn_backend)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer on the residual stream: ``residual`` is the stream so far and ``hidden`` what the layer
        before added to it (in the first layer, the embeddings and None); returns what this layer adds (its
        MLP's output) and the stream before it. So both of a layer's residual adds go into its norms (one
        kernel each on CUDA, engine/kernels/triton_norm.py), the last layer's into the final norm. The sums
        are HF's (``x + r`` and ``r + x`` round alike)."""
        if residual is None:
            residual, normed = hidden, self.input_layernorm(hidden)
        else:
            residual, normed = self.input_layernorm.add_forward(hidden, residual)
        attended = self.self_attn(normed, positions, rotary, kv_caches, meta)
        residual, normed = self.post_attention_layernorm.add_forward(attended, residual)
        return self.mlp(normed), residual


class DecoderStack(nn.Module):
    """HF's ``model.*`` namespace: embeddings, layers, final norm."""

    # Every layer of a decode step in one native call (native_decode.py), where native_path.bind built one
    # when the model loaded.
    native: NativeDecoder | None = None

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        # Always built on the meta device and then assigned the checkpoint's weights (loader._build). An empty
        # weight skips nn.Embedding's normal_ init, which on meta tensors imports torch._dynamo: 1.3-1.5 s of
        # every engine start, the tiny model's included.
        embedding = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, attn_backend) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        self.rotary_emb.start_forward()
        native = self.native
        if native is not None and native.applies(hidden, positions, kv_caches, meta):
            return self.norm(native.run(hidden, positions, kv_caches, meta))
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, positions, self.rotary_emb, kv_caches, meta)
        assert residual is not None, "a model of no layers"
        return self.norm.add_forward(hidden, residual)[1]


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head. With tied embeddings there is no ``lm_head`` parameter at all (HF checkpoints
    omit ``lm_head.weight`` then) and the logits use the embedding matrix, so the two can never drift apart.
    """

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = attn_backend  # the runner asks it whether steps may be captured in CUDA graphs
        self.model = DecoderStack(config, attn_backend)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of this step's tokens; stores their K/V in ``kv_caches``."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[N, vocab]`` for the rows of ``hidden`` the caller samples from."""
        return self.project_logits(hidden).float()

    def project_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits ``[N, vocab]`` in the model's dtype: ``compute_logits`` before its fp32 cast,
        which changes no value (a decode graph draws greedily from them: engine/worker/cuda_graphs.py)."""
        return project(hidden, self.model.embed_tokens if self.lm_head is None else self.lm_head)
