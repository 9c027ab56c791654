"""The native decode step (engine/model/native_decode.py, decode_step.c) against the layers' torch path, which
stays the reference: the same K/V stored, the same hidden states out within the int4 kernel's activation
rounding, on random weights small enough to build in milliseconds.

Both paths run the same int4 matmuls and RMSNorm on the same inputs and write bit-identical RoPE'd keys;
what differs is the softmax's and SiLU's exp and the attention's summation order (~1e-7), which the next
projection's 15-bit activation digits can turn into ~2e-5 of the output. SmolLM2's decode logits through the
native path are held to the int4 tolerance in test_weight_formats.py.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from engine.kernels import AttentionMetadata, TorchAttentionBackend
from engine.model import q4_native
from engine.model.llama import LlamaForCausalLM
from engine.model.native_decode import NativeDecoder, decoder_for
from engine.model.tiny import tiny_config
from engine.model.weights import apply_weight_formats

pytestmark = pytest.mark.skipif(not q4_native.available(), reason="no C compiler or no AVX-512 VNNI here")
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    """Two layers, grouped-query attention (4 query heads on 2 KV heads), random weights, every projection
    int4 and fused: the model shape the native step takes."""
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
    return model.eval()


def decode_step(model: LlamaForCausalLM, seq_lens: list[int], seed: int = 1):
    """Random KV caches (every slot filled, as by earlier steps), one decode token for each sequence of
    ``seq_lens`` (context lengths with the new token) in shuffled blocks, and its metadata."""
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


@pytest.mark.parametrize("seq_lens", [[1], [37], [5, 16, 40]])
def test_the_native_step_matches_the_torch_layers(model: LlamaForCausalLM, seq_lens: list[int]) -> None:
    """One sequence at its first token, one past two 16-wide exp vectors plus a tail, and three of unequal
    lengths (padding in the block tables): the same caches written, hidden states within 1e-4."""
    stack = model.model
    native = NativeDecoder(stack)
    hidden, positions, caches, meta = decode_step(model, seq_lens)
    torch_caches = [cache.clone() for cache in caches]
    with torch.inference_mode():
        expected = hidden.clone()
        for layer in stack.layers:
            expected = layer(expected, positions, stack.rotary_emb, torch_caches, meta)
        assert native.applies(hidden, positions, caches, meta)
        got = native.run(hidden.clone(), positions, caches, meta)
    # The first layer's K/V come from identical inputs through identical maths: equal bit for bit.
    assert torch.equal(caches[0], torch_caches[0])
    assert (caches[1] - torch_caches[1]).abs().max() <= 1e-4 * torch_caches[1].abs().max()
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert not torch.equal(got, hidden)  # it did compute something


@pytest.mark.skipif(os.environ.get("KVGUARD_NATIVE_DECODE") == "0", reason="KVGUARD_NATIVE_DECODE=0 turns it off")
def test_the_model_takes_the_native_step_only_where_it_applies(model: LlamaForCausalLM) -> None:
    """A decode step goes native; a prefill chunk (two new tokens) and an fp32 model take the torch path."""
    assert decoder_for(model.model) is not None
    hidden, positions, caches, meta = decode_step(model, [9])
    assert decoder_for(model.model).applies(hidden, positions, caches, meta)
    prefill = AttentionMetadata.from_host([0, 1], [[0]], [2], [2])
    assert not decoder_for(model.model).applies(torch.zeros(2, 128), torch.arange(2), caches, prefill)
    fp32 = LlamaForCausalLM(dataclasses.replace(model.config), TorchAttentionBackend())
    assert decoder_for(fp32.model) is None
