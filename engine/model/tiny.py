"""The built-in ``tiny`` model: a byte-level Qwen2-style decoder with seeded random weights.

It exists so the whole stack (engine, guard, dashboards, benchmarks) runs and is tested on any machine
without downloading a checkpoint. Its output is meaningless but deterministic, and varied enough that
different prompts give different greedy continuations.
"""

from __future__ import annotations

import torch

from engine.kernels.torch_ref import TorchAttentionBackend
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.prompting.tokenizer import ByteTokenizer

_SEED = 2
# Projections at twice the 1/sqrt(fan_in) scale put the random network in its chaotic regime: continuations
# depend on the whole prompt instead of collapsing onto one repeated byte, as they do at the usual scales.
_PROJECTION_GAIN = 2.0
_BIAS_STD = 0.02
# Embedding rows of printable ASCII (and newline) five times larger than the rest, so the tied LM head
# favours them and demo output reads as (nonsense) text rather than control bytes.
_PRINTABLE_EMBEDDING_STD = 0.1
_OTHER_EMBEDDING_STD = 0.02
_PRINTABLE_IDS = [ord("\n"), *range(ord(" "), ord("~") + 1)]


def tiny_config() -> ModelConfig:
    return ModelConfig(
        architecture="qwen2",
        vocab_size=320,  # 256 bytes + 2 specials, padded to a multiple of 64
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        attention_bias=True,
        attention_output_bias=False,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_ids=(ByteTokenizer.EOS,),
        torch_dtype="float32",
    )


def tiny_state_dict() -> dict[str, torch.Tensor]:
    """The tiny model's fp32 weights; the same on every call and run (a fixed seed on a CPU generator)."""
    with torch.device("meta"):
        shapes = list(LlamaForCausalLM(tiny_config(), TorchAttentionBackend()).named_parameters())
    generator = torch.Generator(device="cpu").manual_seed(_SEED)
    weights: dict[str, torch.Tensor] = {}
    for name, meta in shapes:
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(meta.shape)
        elif name == "model.embed_tokens.weight":
            row_std = torch.full((meta.shape[0], 1), _OTHER_EMBEDDING_STD)
            row_std[_PRINTABLE_IDS] = _PRINTABLE_EMBEDDING_STD
            weights[name] = torch.randn(meta.shape, generator=generator) * row_std
        elif name.endswith(".bias"):
            weights[name] = torch.randn(meta.shape, generator=generator) * _BIAS_STD
        else:
            std = _PROJECTION_GAIN / meta.shape[-1] ** 0.5  # shape[-1] is fan_in for nn.Linear
            weights[name] = torch.randn(meta.shape, generator=generator) * std
    return weights
