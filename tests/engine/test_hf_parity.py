"""The whole engine (scheduler, paged cache, sampler) on checkpoints saved by `transformers` gives the same
greedy tokens as `transformers`' own `generate`, and the same first-step logits to 1e-4 in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from engine import LLM, SamplingParams

SMALL = {"vocab_size": 160, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "eos_token_id": 159,
         "bos_token_id": 1}
PROMPTS = [[1, 17, 33, 90, 4, 4, 150, 61, 12, 9, 100, 3, 77, 20, 5, 6, 7, 8, 44], [1, 5], [1, 99, 98, 97, 96, 95]]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    torch.manual_seed(1)
    if request.param == "llama":
        config = transformers.LlamaConfig(**SMALL, attn_implementation="eager")
    else:
        config = transformers.Qwen2Config(**SMALL, attn_implementation="eager")  # tied: see test_model_hf
    hf_model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # a default init is so flat that greedy ties are likely; sharpen it
        for parameter in hf_model.parameters():
            if parameter.dim() == 2:
                parameter.mul_(4.0)
    directory = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(directory)
    return directory, hf_model


def hf_greedy(hf_model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_tokens_match_transformers(checkpoint) -> None:
    directory, hf_model = checkpoint
    # A small pool and token budget so that the batch is chunked and preempted along the way.
    llm = LLM(str(directory), device="cpu", block_size=4, num_blocks=13, max_num_batched_tokens=8)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0))
    expected = [hf_greedy(hf_model, p) for p in PROMPTS]
    assert llm.telemetry().preemptions_total > 0
    assert len({tuple(e) for e in expected}) == len(PROMPTS) and len({t for e in expected for t in e}) > 10
    for output, want in zip(outputs, expected):
        # HF stops at EOS and so must we; our token list ends with the EOS token just as HF's does.
        assert output.token_ids == want
        assert output.finish_reason == ("stop" if want[-1] == 159 else "length")
    assert outputs[0].text == "", "no tokenizer.json: token ids only"


def test_first_step_logits_match_transformers(checkpoint) -> None:
    directory, hf_model = checkpoint
    llm = LLM(str(directory), device="cpu", block_size=4, num_blocks=64)
    core = llm.core
    for prompt in PROMPTS:
        core.add(core.make_request(prompt, SamplingParams(max_tokens=1, temperature=0.0)))
    out = core.scheduler.schedule()
    ours = core.runner.execute(out).logits
    for row, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            theirs = hf_model(torch.tensor([prompt])).logits[0, -1]
        # fp32 both sides: summation orders apart only, K * 2^-24 of each product's absolute sum (test_gguf.py)
        torch.testing.assert_close(ours[row], theirs, atol=1e-4, rtol=0)
