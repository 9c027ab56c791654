"""Multi-LoRA on a random Llama: greedy tokens identical to `transformers` + `peft` for the base and two
random adapters, each alone, all three in one batch, and under preemption; adapters cached apart from the
base; device slots evicted least recently used; bad adapters refused with one line, nothing loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from support.hf_reference import SMALL, hf_greedy, save_hf_model
from support.lora_adapters import add_peft_adapters, write_adapter

from engine import LLM, SamplingParams
from engine.kv.hashing import root_hash
from engine.model.lora import LoraError, LoraRegistry
from engine.model.tiny import tiny_config

NEW_TOKENS = 8
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15, 16, 17, 18, 19], [5, 5, 5]]
SPECS = {"a1": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"]},
         "a2": {"r": 8, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj", "down_proj"], "use_rslora": True}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    directory = tmp_path_factory.mktemp("lora")
    save_hf_model(transformers.LlamaConfig, SMALL, directory / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(directory / "base", dtype=torch.float32).eval()
    return directory, add_peft_adapters(base, directory, SPECS)


@pytest.fixture(scope="module")
def expected(checkpoint) -> dict[str | None, list[list[int]]]:
    """The reference's greedy tokens per adapter (None: the base) and prompt."""
    _, reference = checkpoint
    result = {}
    with reference.disable_adapter():
        result[None] = [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]
    for name in SPECS:
        reference.set_adapter(name)
        result[name] = [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]
    return result


def _llm(directory: Path, **options) -> LLM:
    return LLM(str(directory / "base"), device="cpu", dtype="float32", max_lora_rank=8,
               loras={name: str(directory / name) for name in SPECS}, **options)


def test_each_adapter_alone_and_all_in_one_batch_match_peft(checkpoint, expected) -> None:
    directory, _ = checkpoint
    llm = _llm(directory)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for lora in (None, *SPECS):
        outputs = llm.generate(PROMPTS, params, lora=lora)
        assert [o.outputs[0].token_ids for o in outputs] == expected[lora], lora
    assert expected[None] != expected["a1"] != expected["a2"], "the adapters change the answers"
    loras = [lora for lora in (None, *SPECS) for _ in PROMPTS]
    outputs = llm.generate(PROMPTS * 3, params, lora=loras)
    assert [o.outputs[0].token_ids for o in outputs] == [t for lora in (None, *SPECS) for t in expected[lora]]
    snapshot = llm.telemetry()
    assert snapshot.loras == snapshot.loras_available == ["a1", "a2"]
    assert snapshot.lora_requests_total == {"a1": 6, "a2": 6}


def test_mixed_batch_matches_peft_under_preemption_with_one_slot(checkpoint, expected) -> None:
    """Six blocks of 4 tokens for nine sequences: they preempt each other; one device slot for two adapters:
    the scheduler runs one adapter at a time beside the base, and the slot changes hands."""
    directory, _ = checkpoint
    llm = _llm(directory, block_size=4, num_blocks=12, max_loras=1, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    loras = [lora for _ in PROMPTS for lora in ("a2", None, "a1")]
    outputs = llm.generate([p for p in PROMPTS for _ in range(3)], params, lora=loras)
    assert llm.telemetry().preemptions_total > 0
    assert [o.outputs[0].token_ids for o in outputs] == [
        expected[lora][i] for i in range(len(PROMPTS)) for lora in ("a2", None, "a1")]
    assert len(llm.telemetry().loras) == 1


def test_base_and_adapter_never_share_a_cached_block(tmp_path: Path) -> None:
    adapter = write_adapter(tmp_path / "a", tiny_config())
    llm = LLM("tiny", device="cpu", block_size=4, loras={"a": str(adapter)})
    prompt = list(range(40, 73))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    log = llm.core.kv.pool.record_events()
    first = llm.generate(prompt, params)[0]
    base_batch = log.drain()
    assert llm.generate(prompt, params, lora="a")[0].num_cached_tokens == 0
    lora_batch = log.drain()  # the KV events say which adapter computed each stored block
    assert base_batch is not None and lora_batch is not None and not base_batch.adapters
    assert lora_batch.adapters == dict.fromkeys(lora_batch.stored, "a") and len(lora_batch.stored) == 8
    assert llm.generate(prompt, params, lora="a")[0].num_cached_tokens == 32
    assert llm.generate(prompt, params)[0].num_cached_tokens == 32
    assert first.outputs[0].token_ids == llm.generate(prompt, params)[0].outputs[0].token_ids
    assert len({root_hash(None), root_hash(None, "a"), root_hash("t", "a"), root_hash("ta")}) == 4


@pytest.mark.parametrize(("change", "problem"), [
    ({"rank": 32}, "rank 32 is over the limit of 16 (--max-lora-rank)"),
    ({"targets": ["q_proj", "embed_tokens"]}, "unsupported target module 'embed_tokens'"),
    ({"extra_config": {"use_dora": True}}, "use_dora=True is not supported"),
    ({"missing": "adapter_model.safetensors"}, "adapter_model.safetensors is missing"),
    ({"missing": "adapter_config.json"}, "adapter_config.json is missing"),
    ({"bad_shape": True}, "has shape (4, 63), expected (4, 64)"),
])
def test_a_bad_adapter_is_one_line_naming_the_problem_and_nothing_is_loaded(tmp_path: Path, change: dict,
                                                                           problem: str) -> None:
    config = tiny_config()
    missing, bad_shape = change.pop("missing", None), change.pop("bad_shape", False)
    directory = write_adapter(tmp_path / "bad", config, **change)
    if missing:
        (directory / missing).unlink()
    if bad_shape:
        tensors = load_file(directory / "adapter_model.safetensors")
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        tensors[key] = tensors[key][:, :-1].contiguous()
        save_file(tensors, str(directory / "adapter_model.safetensors"))
    registry = LoraRegistry(config, max_rank=16)
    with pytest.raises(LoraError) as caught:
        registry.load("bad", directory, reserved={"tiny"})
    message = str(caught.value)
    assert problem in message and str(directory) in message and "\n" not in message, message
    assert registry.names() == []
    with pytest.raises(ValueError, match="lora 'bad'"):
        LLM("tiny", device="cpu", num_blocks=8, loras={"bad": str(directory)})


def test_a_name_keeps_its_weights_for_the_engine_life(tmp_path: Path) -> None:
    """The prefix cache keys blocks by adapter name: reloading a name with other weights is refused."""
    config = tiny_config()
    registry = LoraRegistry(config, max_rank=16)
    registry.load("x", write_adapter(tmp_path / "one", config, seed=1), reserved={"tiny"})
    registry.unload("x")
    with pytest.raises(LoraError, match="served before with other weights"):
        registry.load("x", write_adapter(tmp_path / "two", config, seed=2), reserved={"tiny"})
    registry.load("x", tmp_path / "one", reserved={"tiny"})
    with pytest.raises(LoraError, match="must be a non-empty name other than"):
        registry.load("tiny", tmp_path / "one", reserved={"tiny"})
