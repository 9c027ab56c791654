"""Multi-LoRA on SmolLM2-135M-Instruct (``--model smollm2``, its GGUF; `transformers` converts the same file
for the reference): the base and two random PEFT adapters give `transformers` + `peft`'s greedy tokens,
all three mixed in one batch that chunks its prefills and preempts.

Slow (about 90 s on two shared cores, most of it `transformers` converting the GGUF): tests/engine/test_lora.py
makes the same claims on a random Llama in the default suite."""

from __future__ import annotations

import pytest
from support.hf_reference import hf_greedy, hf_model_from_gguf
from support.lora_adapters import add_peft_adapters

from engine import LLM, SamplingParams
from engine.model.sources import smollm2_path

NEW_TOKENS = 6
QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn.", "List three primary colors."]
SPECS = {"support": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                  "gate_proj", "up_proj", "down_proj"]},
         "legal": {"r": 4, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    path = smollm2_path()
    base = hf_model_from_gguf(path)
    directory = tmp_path_factory.mktemp("smollm2-lora")
    reference = add_peft_adapters(base, directory, SPECS)
    # Blocks of 4 and 20 of them: nine ~25-token sequences need about 60, so they preempt each other.
    llm = LLM("smollm2", device="cpu", dtype="float32", block_size=4, num_blocks=20, max_num_batched_tokens=32,
              weight_format="fp32",
              loras={name: str(directory / name) for name in SPECS})
    loaded = llm.core.loaded
    prompts = [loaded.tokenizer.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n",
                                       add_special_tokens=False) for q in QUESTIONS]
    return llm, reference, prompts


@pytest.mark.slow
def test_base_and_two_adapters_in_one_batch_match_peft_under_preemption(setup) -> None:
    llm, reference, prompts = setup
    expected = {}
    with reference.disable_adapter():
        expected[None] = [hf_greedy(reference, p, NEW_TOKENS) for p in prompts]
    for name in SPECS:
        reference.set_adapter(name)
        expected[name] = [hf_greedy(reference, p, NEW_TOKENS) for p in prompts]
    assert expected[None] != expected["support"] and expected[None] != expected["legal"]
    loras = [None, "support", "legal"]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([p for p in prompts for _ in loras], params, lora=loras * len(prompts))
    assert llm.telemetry().preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outputs] == [expected[lora][i] for i in range(len(prompts))
                                                         for lora in loras]
