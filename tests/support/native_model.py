"""A small decoder the native decode step takes (every projection fused int4, grouped-query attention), on
random weights that build in milliseconds, and one decode step's inputs for it: shared by the native
kernels' tests."""

from __future__ import annotations

import dataclasses

import torch

from engine.kernels import AttentionMetadata, TorchAttentionBackend
from engine.model.llama import LlamaForCausalLM
from engine.model.native_path import bind
from engine.model.tiny import tiny_config
from engine.model.weights import apply_weight_formats

BLOCK_SIZE = 4


def random_int4_model() -> LlamaForCausalLM:
    """Two layers, 4 query heads on 2 KV heads of 32, hidden 128, intermediate 256; bound as the loader binds."""
    config = dataclasses.replace(tiny_config(), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=False)
    model = LlamaForCausalLM(config, TorchAttentionBackend())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.1 * torch.randn(parameter.shape, generator=generator))
            else:
                parameter.copy_(0.08 * torch.randn(parameter.shape, generator=generator))
    linear = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    apply_weight_formats(model, dict.fromkeys(linear, "int4"))
    bind(model)
    return model.eval()


def decode_inputs(model: LlamaForCausalLM, seq_lens: list[int], seed: int = 1):
    """Random KV caches (every slot filled, as by earlier steps), one decode token for each sequence of
    ``seq_lens`` (context lengths with the new token) in shuffled blocks, and its metadata:
    ``(hidden, positions, caches, meta)``."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    shape = (2, 64, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    caches = [torch.randn(shape, generator=generator) for _ in range(config.num_hidden_layers)]
    blocks = torch.randperm(64, generator=generator).tolist()
    tables, start = [], 0
    for n in seq_lens:
        used = -(-n // BLOCK_SIZE)
        tables.append(blocks[start:start + used])
        start += used
    slots = [table[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE for table, n in zip(tables, seq_lens)]
    meta = AttentionMetadata.from_host(slots, tables, [1] * len(seq_lens), seq_lens)
    hidden = torch.randn(len(seq_lens), config.hidden_size, generator=generator)
    positions = torch.tensor([n - 1 for n in seq_lens])
    return hidden, positions, caches, meta
