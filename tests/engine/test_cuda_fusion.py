"""The CUDA path's fusions (engine/model/cuda_fusion.py) compute what the separate ops compute: RMSNorm with
its residual add, RoPE and silu(gate) * up in one Triton kernel each, and q/k/v and gate/up as one dense matrix
each.

Without CUDA the kernel runs in Triton's interpreter (``conftest.py``), on the small shapes it affords; in
16-bit only float16 there (bfloat16 where CUDA compiles the kernel), as in test_kernels_triton.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # before the import below: the kernel module imports triton

import engine.model.cuda_fusion as cuda_fusion  # noqa: PLR0402
from engine import LLM, SamplingParams
from engine.kernels.triton_norm import rms_norm
from engine.kernels.triton_rope import rope
from engine.kernels.triton_rope_store import rope_store_kv
from engine.kernels.triton_silu import silu_mul
from engine.kernels.triton_store import store_kv
from engine.model.config import ModelConfig
from engine.model.llama import RotaryEmbedding

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def separate_ops(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """llama.py's unfused 16-bit RMSNorm, HF's order of ops (the fp32 one is the same maths)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])  # a power of two, and one the kernel's block must mask
def test_fused_add_rms_norm_matches_the_separate_ops(dtype: torch.dtype, hidden: int) -> None:
    generator = torch.Generator().manual_seed(hidden)
    x, residual = (torch.randn(5, hidden, generator=generator).to(DEVICE, dtype) for _ in range(2))
    weight = (1 + torch.randn(hidden, generator=generator) / 4).to(DEVICE, dtype)
    normed, total = rms_norm(x, weight, 1e-6, residual)
    assert total is not None and torch.equal(total, x + residual), "the sum rounds as torch's add"
    expected = separate_ops(x + residual, weight, 1e-6)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # fp32: sum order; 16-bit: one rounding step
    assert (normed.float() - expected.float()).abs().max() <= tolerance * expected.float().abs().max()
    alone, none = rms_norm(x, weight, 1e-6)
    assert none is None
    assert (alone.float() - separate_ops(x, weight, 1e-6).float()).abs().max() <= tolerance * 4


# Four query heads and two key/value heads of 16: what the RoPE tests rotate.
ROPE_CONFIG = ModelConfig(architecture="qwen2", vocab_size=64, hidden_size=64, intermediate_size=64,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
                          tie_word_embeddings=True, attention_bias=False, attention_output_bias=False,
                          bos_token_id=None, eos_token_ids=(), torch_dtype="float32")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_rope_matches_the_separate_ops(dtype: torch.dtype) -> None:
    rotary = RotaryEmbedding(ROPE_CONFIG).to(DEVICE)
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 8, 16, generator=generator).to(DEVICE, dtype)  # q, k and v heads side by side
    heads = qkv[:, :6]  # q and k: a view with v's rows between tokens, as Attention passes it
    positions = torch.tensor([0, 3, 17, 40, 63], device=DEVICE)
    cos = rotary.cos_cache[positions].to(dtype)[:, None, :]  # RotaryEmbedding.rotate's separate ops
    sin = rotary.sin_cache[positions].to(dtype)[:, None, :]
    expected = heads * cos + heads.roll(8, dims=-1) * sin
    ours = rope(heads, positions, rotary.cos_cache, rotary.sin_cache)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # the same roundings, but a compiler may contract
    assert (ours.float() - expected.float()).abs().max() <= tolerance * expected.float().abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_with_the_kv_store_stores_what_rope_then_the_store_do(dtype: torch.dtype) -> None:
    rotary = RotaryEmbedding(ROPE_CONFIG).to(DEVICE)
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 8, 16, generator=generator).to(DEVICE, dtype)  # 4 q, 2 k and 2 v heads side by side
    positions = torch.tensor([0, 3, 17, 40, 63], device=DEVICE)
    slots = torch.tensor([5, 0, -1, 13, 6], device=DEVICE)  # -1: a graph batch's padding row, stored nowhere
    separate = torch.full((2, 4, 4, 2, 16), 7.0, dtype=dtype, device=DEVICE)  # [k|v, block, offset, head, D]
    fused = separate.clone()
    rotated = rope(qkv[:, :6], positions, rotary.cos_cache, rotary.sin_cache)
    store_kv(rotated[:, 4:], qkv[:, 6:], separate, slots)
    query = rope_store_kv(qkv, 4, positions, rotary.cos_cache, rotary.sin_cache, fused, slots)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # one maths (rotate_heads); a compiler may contract
    assert (query.float() - rotated[:, :4].float()).abs().max() <= tolerance * rotated.float().abs().max()
    assert (fused.float() - separate.float()).abs().max() <= tolerance * separate.float().abs().max()
    assert torch.equal(fused[1], separate[1]), "the values are copied as they are"
    written = torch.zeros(16, dtype=torch.bool)
    written[[5, 0, 13, 6]] = True
    assert (fused.flatten(1, 2)[:, ~written.to(DEVICE)] == 7.0).all(), "no other slot is written"
    with pytest.raises(ValueError, match="are not 4 query heads and 1 key and value heads"):
        rope_store_kv(qkv, 4, positions, rotary.cos_cache, rotary.sin_cache, fused[:, :, :, :1], slots)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_silu_mul_matches_the_separate_ops(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    gate_up = (3 * torch.randn(3, 2 * 1100, generator=generator)).to(DEVICE, dtype)  # two column blocks
    gate, up = gate_up.split(1100, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # exp's last bits can move a rounding
    assert (silu_mul(gate, up).float() - expected.float()).abs().max() <= tolerance * expected.float().abs().max()


# The Triton backend stores the keys and values with RoPE (triton_rope_store.py); the torch one after it. The
# unfused tokens come from the torch backend either way: test_kernels_triton.py holds the two backends' greedy
# tokens equal (and the torch one is the quicker in Triton's interpreter).
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_fused_model_gives_the_unfused_tokens(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    prompts = [[3, 14, 15, 92, 65, 35], [89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    options = {"model": "tiny", "device": DEVICE.type, "dtype": "float32", "num_blocks": 32}
    unfused = [o.token_ids for o in LLM(**options, attention_backend="torch").generate(prompts, params)]
    # Without CUDA, this stands in for a CUDA tensor: the fused path is the subject, not the device.
    monkeypatch.setattr(cuda_fusion, "applies", lambda tensor: True)
    llm = LLM(**options, attention_backend=backend)
    attention, mlp = llm.core.loaded.model.model.layers[0].self_attn, llm.core.loaded.model.model.layers[0].mlp
    assert type(attention.qkv_proj) is torch.nn.Linear and attention.qkv_proj.bias is not None
    assert type(mlp.gate_up_proj) is torch.nn.Linear and not hasattr(mlp, "gate_proj")
    assert [o.token_ids for o in llm.generate(prompts, params)] == unfused
