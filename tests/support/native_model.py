"""A small decoder the native decode step takes (every projection fused int4, grouped-query attention), on
random weights that build in milliseconds, and one decode step's inputs for it: shared by the native
kernels' tests and bench/cpu_numerics.py.

The random numbers come from numpy's generator, whose draws are the same on every CPU: torch's own normal
sampler takes a vectorized path chosen by ATen's CPU capability, so its draws (and with them every figure
compared across machines) would move with the CPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from engine.kernels import AttentionMetadata, TorchAttentionBackend
from engine.kernels.native import q4
from engine.model.llama import DecoderLayer, LlamaForCausalLM
from engine.model.native_path import bind
from engine.model.tiny import tiny_config
from engine.model.weights import apply_weight_formats
from support.activation_digits import LOW_STEPS

BLOCK_SIZE = 4


def normal(rng: np.random.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Standard normal float32 draws, the same on every CPU."""
    return torch.from_numpy(rng.standard_normal(shape, dtype=np.float32))


def random_int4_model() -> LlamaForCausalLM:
    """Two layers, 4 query heads on 2 KV heads of 32, hidden 128, intermediate 256; bound as the loader binds."""
    config = dataclasses.replace(tiny_config(), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=False)
    model = LlamaForCausalLM(config, TorchAttentionBackend())
    rng = np.random.default_rng(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.1 * normal(rng, parameter.shape))
            else:
                parameter.copy_(0.08 * normal(rng, parameter.shape))
    linear = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    apply_weight_formats(model, dict.fromkeys(linear, "int4"))
    bind(model)
    return model.eval()


def decode_inputs(model: LlamaForCausalLM, seq_lens: list[int], seed: int = 1):
    """Random KV caches (every slot filled, as by earlier steps), one decode token for each sequence of
    ``seq_lens`` (context lengths with the new token) in shuffled blocks, and its metadata:
    ``(hidden, positions, caches, meta)``."""
    config = model.config
    rng = np.random.default_rng(seed)
    shape = (2, 64, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    caches = [normal(rng, shape) for _ in range(config.num_hidden_layers)]
    blocks = rng.permutation(64).tolist()
    tables, start = [], 0
    for n in seq_lens:
        used = -(-n // BLOCK_SIZE)
        tables.append(blocks[start:start + used])
        start += used
    slots = [table[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for table, n in zip(tables, seq_lens)]
    meta = AttentionMetadata.from_host(slots, tables, [1] * len(seq_lens), seq_lens)
    hidden = normal(rng, (len(seq_lens), config.hidden_size))
    positions = torch.tensor([n - 1 for n in seq_lens])
    return hidden, positions, caches, meta


def torch_layer(layer: DecoderLayer, hidden: torch.Tensor, positions: torch.Tensor, rotary, cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, float]:
    """The layer's torch path on ``hidden`` (storing into ``cache``), and its flip bound: how far a path that
    differs from it only by rounding may be, once the next projections' activation digits amplify that
    (tests/engine/test_native_decode.py's docstring). A projection's output row moves by at most one low
    step per input, ``sum_k |W[n, k]| * max|x| / (127 * 254)``; a layer adds o and down to its output."""
    largest: dict[str, float] = {}
    projections = {"o": layer.self_attn.o_proj, "down": layer.mlp.down_proj}
    hooks = [m.register_forward_pre_hook(lambda _, args, name=name: largest.__setitem__(name, args[0].abs().max()))
             for name, m in projections.items()]
    try:
        added, residual = layer(hidden, None, positions, rotary, [cache] * (layer.self_attn.layer_index + 1), meta)
        out = residual + added  # the layer's whole output, as the next layer's input norm adds it
    finally:
        for hook in hooks:
            hook.remove()
    bound = sum(q4.unpack(m.qpack, m.scales, torch.float32).abs().sum(1).max().item() * largest[name].item() / LOW_STEPS
                for name, m in projections.items())
    return out, bound
