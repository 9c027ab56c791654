"""Our decoder, loaded from a `transformers` checkpoint, against that checkpoint run by HF's eager code."""

from __future__ import annotations

import pytest
import torch
import transformers
from support.hf_reference import SMALL, save_hf_model
from support.single_sequence import SingleSequence

from engine.kernels import TorchAttentionBackend
from engine.model.loader import LoadedModel, load_model

TOLERANCE = 1e-4  # fp32 both sides: summation orders apart only (K <= 128: ~3e-5 worst case, test_gguf.py)
PROMPT = [5, 17, 99, 3, 42, 8, 8, 120, 64, 1, 77]  # 11 tokens: crosses two 4-token block boundaries
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so that all three frequency bands occur at head_dim 16
}

CASES = {
    "llama": (transformers.LlamaConfig, dict(SMALL)),
    "llama-llama3-rope": (transformers.LlamaConfig, dict(SMALL, rope_parameters=LLAMA3_ROPE)),
    "llama-linear-rope-bias": (
        transformers.LlamaConfig,
        dict(SMALL, attention_bias=True, rope_parameters=LINEAR_ROPE),
    ),
    "qwen2": (transformers.Qwen2Config, dict(SMALL)),
    "qwen2-tied": (transformers.Qwen2Config, dict(SMALL, tie_word_embeddings=True)),
}


@pytest.fixture(params=list(CASES), scope="module")
def models(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[transformers.PreTrainedModel, LoadedModel]:
    config_class, kwargs = CASES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = save_hf_model(config_class, kwargs, directory)
    ours = load_model(str(directory), torch.device("cpu"), torch.float32, TorchAttentionBackend())
    return hf_model, ours


def hf_logits(hf_model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def test_prefill_logits_match_hf(models: tuple[transformers.PreTrainedModel, LoadedModel]) -> None:
    hf_model, ours = models
    logits = SingleSequence(ours.model).step(PROMPT)
    expected = hf_logits(hf_model, PROMPT)
    assert logits.dtype == torch.float32
    assert (logits - expected).abs().max().item() < TOLERANCE


def test_chunked_prefill_and_decode_match_hf(
    models: tuple[transformers.PreTrainedModel, LoadedModel],
) -> None:
    hf_model, ours = models
    sequence = SingleSequence(ours.model, seed=1)
    tokens = list(PROMPT)
    steps = [sequence.step(PROMPT[:6]), sequence.step(PROMPT[6:])]
    for _ in range(5):
        tokens.append(int(hf_logits(hf_model, tokens)[-1].argmax()))  # HF's own greedy choice
        steps.append(sequence.step(tokens[-1:]))

    expected = hf_logits(hf_model, tokens)
    assert (torch.cat(steps) - expected).abs().max().item() < TOLERANCE


def test_checkpoint_names_load_one_to_one(models: tuple[transformers.PreTrainedModel, LoadedModel]) -> None:
    hf_model, ours = models
    ours_names = {name for name, _ in ours.model.named_parameters()}
    hf_names = {name for name, _ in hf_model.named_parameters()}  # HF also dedups a tied lm_head
    assert ours_names == hf_names
    assert not any(p.requires_grad for p in ours.model.parameters())
    assert not ours.model.training
    assert ours.config.num_parameters() == sum(p.numel() for p in ours.model.parameters())
