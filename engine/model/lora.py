"""LoRA adapters: reading a PEFT directory, checking it against the base model, and the registry of the
adapters an engine serves.

A PEFT directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ...) and
``adapter_model.safetensors`` with, per adapted projection, ``...layers.N.self_attn.q_proj.lora_A.weight``
``[r, in]`` and ``...lora_B.weight`` ``[out, r]``. The adapted output is ``W x + scaling * B (A x)`` with
``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``), exactly PEFT's.

Everything is checked before an adapter is accepted (files, config fields, every tensor's name and shape,
the rank limit); a bad adapter raises ``LoraError`` with one line naming the directory and the problem, and
nothing is registered. Weights stay on the host here, in fp32; engine/model/lora_slots.py copies the
adapters a step needs into device slots.

Invariant of the registry: a name stands for one set of weights for the engine's whole life. The prefix
cache keys blocks by adapter name (engine/kv/hashing.py), so a name unloaded and loaded again with other
weights would hit KV computed by the old ones; such a load is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.model.config import ModelConfig

# The projections an adapter may target, as PEFT names them, and the block they live in.
TARGET_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# PEFT features that change the maths; an adapter using one is refused rather than served wrongly.
_UNSUPPORTED = {"use_dora": (False, None), "rank_pattern": ({}, None), "alpha_pattern": ({}, None),
                "modules_to_save": (None, []), "layers_to_transform": (None,), "bias": ("none",),
                "fan_in_fan_out": (False,)}


class LoraError(ValueError):
    """An adapter that cannot be served: one line naming the directory (or name) and the problem."""


@dataclass(slots=True, frozen=True, eq=False)
class LoraAdapter:
    """One adapter's host weights: ``weights[(layer, module)] = (A [r, in], B [out, r])``, fp32."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str  # of the config and weight files: tells a reload with other weights from the same ones


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``(in, out)`` of every projection an adapter may target."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size, kv_size = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
            "o_proj": (q_size, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check the PEFT directory ``path`` for ``config``'s model; ``LoraError`` if it cannot serve."""
    directory = Path(path)
    where = f"lora {name!r} ({directory})"
    if not directory.is_dir():
        raise LoraError(f"{where}: not a directory")
    settings = _read_config(directory / CONFIG_FILE, where)
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank > 0):
        raise LoraError(f"{where}: {CONFIG_FILE}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraError(f"{where}: rank {rank} is over the limit of {max_rank} (--max-lora-rank)")
    if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and alpha > 0):
        raise LoraError(f"{where}: {CONFIG_FILE}: lora_alpha must be a positive number, got {alpha!r}")
    for key, allowed in _UNSUPPORTED.items():
        if settings.get(key, allowed[0]) not in allowed:
            raise LoraError(f"{where}: {CONFIG_FILE}: {key}={settings[key]!r} is not supported")
    _check_target_modules(settings.get("target_modules"), where)
    weights = _read_weights(directory / WEIGHTS_FILE, where, rank, config)
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    digest = hashlib.blake2b((directory / CONFIG_FILE).read_bytes() + (directory / WEIGHTS_FILE).read_bytes(),
                             digest_size=16).hexdigest()
    return LoraAdapter(name, str(directory), rank, float(scaling), weights, digest)


def _read_config(path: Path, where: str) -> dict:
    try:
        settings = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoraError(f"{where}: {path.name} is missing") from None
    except (OSError, ValueError) as exc:
        raise LoraError(f"{where}: {path.name} is not readable JSON: {exc}") from None
    if not isinstance(settings, dict):
        raise LoraError(f"{where}: {path.name} must hold a JSON object")
    return settings


def _check_target_modules(targets: object, where: str) -> None:
    """A list must name supported projections only; a string (PEFT's regex form) is judged by the tensors."""
    if isinstance(targets, list):
        unsupported = [t for t in targets if t not in TARGET_MODULES]
        if unsupported:
            raise LoraError(f"{where}: unsupported target module {unsupported[0]!r}; supported: "
                            f"{', '.join(TARGET_MODULES)}")


def _read_weights(path: Path, where: str, rank: int, config: ModelConfig
                  ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    if not path.is_file():
        raise LoraError(f"{where}: {path.name} is missing")
    shapes = projection_shapes(config)
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            keys = handle.keys()  # the handle itself is not iterable
            for key in keys:
                layer, module, kind = _parse_key(key, where, config.num_hidden_layers)
                fan_in, fan_out = shapes[module]
                expected = (rank, fan_in) if kind == "A" else (fan_out, rank)
                tensor = handle.get_tensor(key)
                if tuple(tensor.shape) != expected:
                    raise LoraError(f"{where}: tensor '{key}' has shape {tuple(tensor.shape)}, expected {expected}")
                found[(layer, module, kind)] = tensor.float()
    except SafetensorError as exc:
        raise LoraError(f"{where}: {path.name} is not a readable safetensors file: {exc}") from None
    weights = {}
    for (layer, module, kind), tensor in found.items():
        other = "B" if kind == "A" else "A"
        if (layer, module, other) not in found:
            raise LoraError(f"{where}: layer {layer} {module} has lora_{kind} but no lora_{other}")
        if kind == "A":
            weights[(layer, module)] = (tensor, found[(layer, module, "B")])
    if not weights:
        raise LoraError(f"{where}: {path.name} holds no LoRA tensors")
    return weights


def _parse_key(key: str, where: str, num_layers: int) -> tuple[int, str, str]:
    match = _TENSOR.match(key)
    if match is None:
        raise LoraError(f"{where}: unexpected tensor '{key}' (only LoRA A/B weights of decoder projections)")
    layer, block, module, kind = int(match[1]), match[2], match[3], match[4]
    if TARGET_MODULES.get(module) != block:
        raise LoraError(f"{where}: unsupported target module {module!r}; supported: {', '.join(TARGET_MODULES)}")
    if layer >= num_layers:
        raise LoraError(f"{where}: tensor '{key}' names layer {layer}; the model has {num_layers}")
    return layer, module, kind


@dataclass(slots=True)
class LoraRegistry:
    """The adapters an engine serves, by name; safe to change from the server's thread while the engine
    steps (a request holds its ``LoraAdapter`` itself, so an unload never pulls weights from under it)."""

    config: ModelConfig
    max_rank: int
    adapters: dict[str, LoraAdapter] = field(default_factory=dict)
    _digests: dict[str, str] = field(default_factory=dict)  # every name ever served (module invariant)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def load(self, name: str, path: str | Path, reserved: set[str]) -> LoraAdapter:
        """Read ``path`` and serve it as ``name``; ``reserved`` holds names that may not be used (the base)."""
        if not isinstance(name, str) or not name.strip() or name in reserved:
            raise LoraError(f"lora name {name!r}: must be a non-empty name other than {sorted(reserved)}")
        adapter = load_adapter(name, path, self.config, self.max_rank)
        with self._lock:
            if name in self.adapters:
                raise LoraError(f"lora {name!r}: already loaded (from {self.adapters[name].path})")
            if self._digests.get(name, adapter.digest) != adapter.digest:
                raise LoraError(f"lora {name!r}: was served before with other weights; its cached KV is keyed "
                                f"by name, so load these under a new name")
            self._digests[name] = adapter.digest
            self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> LoraAdapter:
        with self._lock:
            adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoraError(f"lora {name!r}: not loaded")
        return adapter

    def get(self, name: str) -> LoraAdapter | None:
        return self.adapters.get(name)

    def names(self) -> list[str]:
        with self._lock:  # a load on the server's worker thread may be inserting meanwhile
            return sorted(self.adapters)
