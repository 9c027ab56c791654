"""Bad model directories fail with a `ModelLoadError` that names the file and the field or tensor at fault."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.kernels import TorchAttentionBackend
from engine.model.config import LinearRopeScaling, Llama3RopeScaling, ModelConfig
from engine.model.errors import ModelLoadError
from engine.model.loader import LoadedModel, load_model


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    directory = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.fixture
def model_dir(saved_llama: Path, tmp_path: Path) -> Path:
    """A fresh, writable copy of a valid checkpoint directory."""
    return Path(shutil.copytree(saved_llama, tmp_path / "model"))


def load(directory: Path) -> LoadedModel:
    return load_model(str(directory), torch.device("cpu"), torch.float32, TorchAttentionBackend())


def edit_config(directory: Path, change: Callable[[dict], None]) -> None:
    path = directory / "config.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=2))


def edit_weights(directory: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    path = directory / "model.safetensors"
    weights = load_file(path)
    change(weights)
    save_file(weights, path, metadata={"format": "pt"})


def test_valid_directory_loads(model_dir: Path) -> None:
    loaded = load(model_dir)
    assert loaded.config.architecture == "llama" and loaded.tokenizer is None
    assert loaded.name == "model", "served as the directory's name, never its path"
    assert load(Path(f"{model_dir}/")).name == "model"


def test_missing_directory_names_the_field_and_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="^model: ") as info:
        load(missing)
    assert str(missing) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_missing_config_file(model_dir: Path) -> None:
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json: file not found"):
        load(model_dir)


def test_malformed_json_names_file_and_line(model_dir: Path) -> None:
    (model_dir / "config.json").write_text('{\n  "hidden_size": 32,\n  "vocab_size": ,\n}\n')
    with pytest.raises(ModelLoadError, match=r"config\.json: invalid JSON at line 3"):
        load(model_dir)


def test_malformed_generation_config(model_dir: Path) -> None:
    (model_dir / "generation_config.json").write_text("[1, 2")
    with pytest.raises(ModelLoadError, match=r"generation_config\.json: invalid JSON at line 1"):
        load(model_dir)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.pop("num_attention_heads"), r"config\.json: field 'num_attention_heads' is missing"),
        (lambda c: c.pop("rms_norm_eps"), r"config\.json: field 'rms_norm_eps' is missing"),
        (
            lambda c: c.update(hidden_size="abc"),
            r"config\.json: field 'hidden_size' must be a positive integer, got 'abc'",
        ),
        (
            lambda c: c.update(num_hidden_layers=True),
            r"field 'num_hidden_layers' must be a positive integer, got True",
        ),
        (lambda c: c.update(vocab_size=0), r"field 'vocab_size' must be a positive integer, got 0"),
        (lambda c: c.update(rms_norm_eps="tiny"), r"field 'rms_norm_eps' must be a positive number"),
        (lambda c: c.update(tie_word_embeddings="yes"), r"field 'tie_word_embeddings' must be true or false"),
        (lambda c: c.update(eos_token_id=[2, "x"]), r"field 'eos_token_id' must be a token id or a list"),
        (lambda c: c.update(architectures=["GPT2LMHeadModel"]), r"field 'architectures' names no supported"),
        (lambda c: c.update(num_key_value_heads=3), r"field 'num_attention_heads' \(4\) must be divisible"),
        (
            lambda c: (c.pop("head_dim"), c.update(hidden_size=30)),
            r"field 'hidden_size' \(30\) must be divisible",
        ),
        (lambda c: c.update(hidden_act="gelu"), r"field 'hidden_act' must be 'silu'"),
        (
            lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
            r"config\.json: field 'rope_scaling' has unsupported rope_type 'yarn'",
        ),
        (
            lambda c: c.update(rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}),
            r"field 'rope_scaling\.high_freq_factor' is missing",
        ),
    ],
)
def test_bad_config_fields(model_dir: Path, change: Callable[[dict], None], message: str) -> None:
    edit_config(model_dir, change)
    with pytest.raises(ModelLoadError, match=message):
        load(model_dir)


def test_no_weight_files(model_dir: Path) -> None:
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weight files") as info:
        load(model_dir)
    assert str(model_dir) in str(info.value)


def test_missing_tensor(model_dir: Path) -> None:
    edit_weights(model_dir, lambda w: w.pop("model.norm.weight"))
    with pytest.raises(ModelLoadError, match=r"tensors missing from model\.safetensors: model\.norm\.weight"):
        load(model_dir)


def test_wrong_shape(model_dir: Path) -> None:
    name = "model.layers.0.self_attn.k_proj.weight"
    edit_weights(model_dir, lambda w: w.update({name: torch.zeros(8, 32)}))
    with pytest.raises(
        ModelLoadError, match=rf"model\.safetensors: tensor '{name}' has shape \(8, 32\), expected \(16, 32\)"
    ):
        load(model_dir)


def test_unknown_tensor_is_an_error_but_inv_freq_is_ignored(model_dir: Path) -> None:
    edit_weights(
        model_dir, lambda w: w.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    )
    load(model_dir)
    edit_weights(model_dir, lambda w: w.update({"model.layers.0.mlp.extra.weight": torch.ones(4)}))
    with pytest.raises(
        ModelLoadError,
        match=r"unexpected tensors: model\.layers\.0\.mlp\.extra\.weight \(model\.safetensors\)",
    ):
        load(model_dir)


def test_corrupt_weight_file(model_dir: Path) -> None:
    (model_dir / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: not a readable safetensors file"):
        load(model_dir)


def test_generation_config_eos_wins(model_dir: Path) -> None:
    edit_config(model_dir, lambda c: c.update(eos_token_id=2, bos_token_id=1))
    assert ModelConfig.from_hf_dir(model_dir).eos_token_ids == (2,)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    config = ModelConfig.from_hf_dir(model_dir)
    assert config.eos_token_ids == (2, 7) and config.bos_token_id == 1


def test_transformers_4_and_5_config_layouts_agree(model_dir: Path) -> None:
    llama3 = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }

    def v5(config: dict) -> None:
        config.pop("rope_theta", None)
        config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, **llama3}

    def v4(config: dict) -> None:
        config.pop("rope_parameters", None)
        config.update(rope_theta=500000.0, rope_scaling={"type": "llama3", **llama3})

    edit_config(model_dir, v5)
    from_v5 = ModelConfig.from_hf_dir(model_dir)
    edit_config(model_dir, v4)
    from_v4 = ModelConfig.from_hf_dir(model_dir)
    assert from_v4 == from_v5
    assert from_v4.rope_theta == 500000.0 and from_v4.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 64)

    edit_config(model_dir, lambda c: c.update(rope_scaling={"type": "linear", "factor": 2}))
    assert ModelConfig.from_hf_dir(model_dir).rope_scaling == LinearRopeScaling(2.0)
    edit_config(model_dir, lambda c: c.update(rope_scaling=None))
    assert ModelConfig.from_hf_dir(model_dir).rope_scaling is None


def test_kv_bytes_per_token(model_dir: Path) -> None:
    config = ModelConfig.from_hf_dir(model_dir)
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 1 * 2 * 8 * 2
    assert config.kv_bytes_per_token(torch.float32) == 2 * 1 * 2 * 8 * 4
