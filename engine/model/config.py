"""Model hyper-parameters, parsed and validated from a Hugging Face `config.json` (+ `generation_config.json`).

Parsing is strict: a field that is present must have the right type, and a field that the model cannot do
without must be present; every failure is a `ModelLoadError` naming the file and the field. Fields that
Hugging Face itself defaults (``num_key_value_heads``, ``head_dim``, ``rope_theta``, ``tie_word_embeddings``,
``attention_bias``, the special token ids) take the same defaults here, so a checkpoint that loads in
`transformers` loads here too.

Both config layouts are accepted: the transformers 4.x one (``rope_theta`` and ``rope_scaling`` at the top
level) and the 5.x one (``rope_parameters`` holding ``rope_theta``, ``rope_type`` and the scaling fields).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from engine.model.errors import ModelLoadError

Architecture = Literal["llama", "qwen2"]

_ARCHITECTURES: dict[str, Architecture] = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_MODEL_TYPES: dict[str, Architecture] = {"llama": "llama", "qwen2": "qwen2"}
_DEFAULT_ROPE_THETA = 10000.0
_MISSING = object()  # sentinel: a field without a default


@dataclass(slots=True, frozen=True)
class LinearRopeScaling:
    """Every RoPE frequency divided by ``factor`` (position interpolation)."""

    factor: float


@dataclass(slots=True, frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 RoPE scaling: high frequencies kept, low ones divided by ``factor``, a smooth blend between.

    The band edges are the wavelengths ``original_max_position_embeddings / high_freq_factor`` and
    ``original_max_position_embeddings / low_freq_factor``.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


RopeScaling = LinearRopeScaling | Llama3RopeScaling


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Everything the decoder needs to be built; immutable once parsed.

    Invariants (checked by `from_hf_dir`, relied on by the model): ``num_attention_heads`` is a multiple of
    ``num_key_value_heads``; ``head_dim`` is even (RoPE rotates pairs); ``eos_token_ids`` may be empty, in
    which case only ``max_tokens`` and stop strings end a generation.
    """

    architecture: Architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v
    attention_output_bias: bool  # bias on o_proj: Llama's attention_bias covers it, Qwen2 never has one
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None  # the checkpoint's dtype as written in config.json, informational only

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        """Parse ``path/config.json`` and, when present, ``path/generation_config.json``.

        The generation config's ``eos_token_id``/``bos_token_id`` win over config.json's, as in HF
        ``generate``: instruct checkpoints often list their end-of-turn token only there.
        """
        directory = Path(path)
        fields = _Fields.read(directory / "config.json")
        generation_path = directory / "generation_config.json"
        generation = _Fields.read(generation_path) if generation_path.exists() else None
        architecture = _architecture(fields)

        num_heads = fields.positive_int("num_attention_heads")
        hidden_size = fields.positive_int("hidden_size")
        num_kv_heads = fields.optional_positive_int("num_key_value_heads") or num_heads
        head_dim = fields.optional_positive_int("head_dim")
        if head_dim is None:
            if hidden_size % num_heads:
                raise fields.error(
                    "hidden_size", f"({hidden_size}) must be divisible by num_attention_heads ({num_heads})"
                )
            head_dim = hidden_size // num_heads
        if head_dim % 2:
            raise fields.error("head_dim", f"must be even for rotary embeddings, got {head_dim}")
        if num_heads % num_kv_heads:
            raise fields.error(
                "num_attention_heads",
                f"({num_heads}) must be divisible by num_key_value_heads ({num_kv_heads})",
            )
        _reject_unsupported_features(fields)

        llama_bias = architecture == "llama" and fields.boolean("attention_bias", default=False)
        eos_token_ids = fields.token_ids("eos_token_id")
        bos_token_id = fields.token_id("bos_token_id")
        if generation is not None and generation.has("eos_token_id"):
            eos_token_ids = generation.token_ids("eos_token_id")
        if generation is not None and generation.has("bos_token_id"):
            bos_token_id = generation.token_id("bos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=fields.positive_int("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=fields.positive_int("intermediate_size"),
            num_hidden_layers=fields.positive_int("num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=fields.positive_float("rms_norm_eps"),
            rope_theta=_rope_theta(fields),
            rope_scaling=_rope_scaling(fields),
            max_position_embeddings=fields.positive_int("max_position_embeddings"),
            tie_word_embeddings=fields.boolean("tie_word_embeddings", default=False),
            # Qwen2 always has q/k/v bias and its config has no switch for it.
            attention_bias=architecture == "qwen2" or llama_bias,
            attention_output_bias=llama_bias,
            bos_token_id=bos_token_id,
            eos_token_ids=eos_token_ids,
            torch_dtype=fields.optional_str("torch_dtype") or fields.optional_str("dtype"),
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of KV cache one token occupies across all layers (K and V)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype.itemsize

    def num_parameters(self) -> int:
        """Parameter count of the decoder built from this config (a tied lm_head is counted once)."""
        q_size = self.num_attention_heads * self.head_dim
        kv_size = self.num_key_value_heads * self.head_dim
        attention = self.hidden_size * (q_size + 2 * kv_size) + q_size * self.hidden_size
        if self.attention_bias:
            attention += q_size + 2 * kv_size
        if self.attention_output_bias:
            attention += self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        layer = attention + mlp + 2 * self.hidden_size
        embeddings = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embeddings
        return embeddings + self.num_hidden_layers * layer + self.hidden_size + lm_head


class _Fields:
    """Typed access to one JSON object; every error names the file and the field."""

    __slots__ = ("data", "path")

    def __init__(self, path: Path, data: dict[str, Any]) -> None:
        self.path = path
        self.data = data

    @classmethod
    def read(cls, path: Path) -> _Fields:
        if not path.is_file():
            raise ModelLoadError(f"{path}: file not found")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ModelLoadError(
                f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}"
            ) from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{path}: cannot be read: {exc}") from None
        if not isinstance(data, dict):
            raise ModelLoadError(f"{path}: must hold a JSON object, got {type(data).__name__}")
        return cls(path, data)

    def error(self, name: str, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: field '{name}' {problem}")

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def _get(self, name: str, default: Any) -> Any:
        if self.has(name):
            return self.data[name]
        if default is _MISSING:
            raise self.error(name, "is missing")
        return default

    def positive_int(self, name: str) -> int:
        value = self._get(name, _MISSING)
        if not _is_int(value) or value <= 0:
            raise self.error(name, f"must be a positive integer, got {value!r}")
        return value

    def optional_positive_int(self, name: str) -> int | None:
        return self.positive_int(name) if self.has(name) else None

    def positive_float(self, name: str) -> float:
        value = self._get(name, _MISSING)
        if not _is_number(value) or not math.isfinite(value) or value <= 0:
            raise self.error(name, f"must be a positive number, got {value!r}")
        return float(value)

    def boolean(self, name: str, *, default: bool) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise self.error(name, f"must be true or false, got {value!r}")
        return value

    def optional_str(self, name: str) -> str | None:
        value = self._get(name, None)
        if value is not None and not isinstance(value, str):
            raise self.error(name, f"must be a string, got {value!r}")
        return value

    def token_id(self, name: str) -> int | None:
        value = self._get(name, None)
        if value is not None and (not _is_int(value) or value < 0):
            raise self.error(name, f"must be a non-negative integer, got {value!r}")
        return value

    def token_ids(self, name: str) -> tuple[int, ...]:
        value = self._get(name, None)
        if value is None:
            return ()
        values = value if isinstance(value, list) else [value]
        if not all(_is_int(v) and v >= 0 for v in values):
            raise self.error(name, f"must be a token id or a list of token ids, got {value!r}")
        return tuple(values)

    def nested(self, name: str) -> _Fields:
        """The JSON object under ``name``, with errors naming ``name.sub_field``."""
        value = self._get(name, _MISSING)
        if not isinstance(value, dict):
            raise self.error(name, f"must be an object, got {value!r}")
        return _NestedFields(self.path, value, prefix=f"{name}.")


class _NestedFields(_Fields):
    __slots__ = ("prefix",)

    def __init__(self, path: Path, data: dict[str, Any], *, prefix: str) -> None:
        super().__init__(path, data)
        self.prefix = prefix

    def error(self, name: str, problem: str) -> ModelLoadError:
        return super().error(self.prefix + name, problem)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _architecture(fields: _Fields) -> Architecture:
    if fields.has("architectures"):
        names = fields.data["architectures"]
        if not isinstance(names, list):
            raise fields.error("architectures", f"must be a list of class names, got {names!r}")
        for name in names:
            if name in _ARCHITECTURES:
                return _ARCHITECTURES[name]
        raise fields.error(
            "architectures",
            f"names no supported architecture (supported: {', '.join(_ARCHITECTURES)}), got {names!r}",
        )
    model_type = fields.optional_str("model_type")
    if model_type is None:
        raise fields.error("architectures", "is missing (and so is 'model_type')")
    if model_type not in _MODEL_TYPES:
        raise fields.error("model_type", f"must be one of {', '.join(_MODEL_TYPES)}, got {model_type!r}")
    return _MODEL_TYPES[model_type]


def _reject_unsupported_features(fields: _Fields) -> None:
    """Fail loudly on switches that would silently change the maths if ignored."""
    if fields.has("hidden_act") and fields.data["hidden_act"] != "silu":
        raise fields.error("hidden_act", f"must be 'silu', got {fields.data['hidden_act']!r}")
    if fields.boolean("mlp_bias", default=False):
        raise fields.error("mlp_bias", "is not supported (must be false)")
    if fields.boolean("use_sliding_window", default=False):
        raise fields.error("use_sliding_window", "is not supported (must be false)")


def _rope_source(fields: _Fields) -> str | None:
    """Where the RoPE settings live: 4.x ``rope_scaling`` wins over 5.x ``rope_parameters``."""
    for name in ("rope_scaling", "rope_parameters"):
        if fields.has(name):
            return name
    return None


def _rope_theta(fields: _Fields) -> float:
    if fields.has("rope_theta"):
        return fields.positive_float("rope_theta")
    if fields.has("rope_parameters"):
        params = fields.nested("rope_parameters")
        if params.has("rope_theta"):
            return params.positive_float("rope_theta")
    return _DEFAULT_ROPE_THETA


def _rope_scaling(fields: _Fields) -> RopeScaling | None:
    source = _rope_source(fields)
    if source is None:
        return None
    params = fields.nested(source)
    rope_type = params.data.get("rope_type", params.data.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return LinearRopeScaling(factor=params.positive_float("factor"))
    if rope_type == "llama3":
        low = params.positive_float("low_freq_factor")
        high = params.positive_float("high_freq_factor")
        if high <= low:
            raise params.error("high_freq_factor", f"({high}) must be greater than low_freq_factor ({low})")
        return Llama3RopeScaling(
            factor=params.positive_float("factor"),
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=params.positive_int("original_max_position_embeddings"),
        )
    raise fields.error(
        source, f"has unsupported rope_type {rope_type!r} (supported: default, linear, llama3)"
    )
