"""The workload file of the capacity planner: a YAML mapping validated by pydantic, unknown keys refused.

Every model forbids extra keys and every number has its bounds, so a typo (``stream: 40``) or a sign slip
(``margin: -0.3``) is an error naming the key instead of a plan computed from a default. The mix's shares
must add up to 1: they weight the peak streams, and shares that do not add up would silently scale demand.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

# guard/config.py's loader refuses a key given twice (PyYAML keeps the last silently); one loader for both files.
from guard.config import _UniqueKeyLoader, format_validation_error

# Shares are written by hand as decimals (0.7, 0.2, 0.1); their float sum is 1 only up to rounding.
SHARE_TOLERANCE = 1e-6


class PlanError(ValueError):
    """The plan cannot be made from this input; the message names the file, key or URL at fault."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ExplicitModel(Strict):
    """A model given by the numbers that size its KV cache and its weights."""

    layers: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    kv_bytes: int = Field(gt=0)  # bytes per cached element: 1 for FP8, 2 for BF16/FP16
    weight_bytes: int = Field(ge=0)
    context_window: int | None = Field(None, gt=0)  # tokens (input + output) one request may hold; None: unchecked


class NamedModel(Strict):
    """A model whose shape is read from its files: ``smollm2``, a Hugging Face directory or a ``.gguf`` file
    (a relative path is taken from the workload file's folder)."""

    name: str = Field(min_length=1)
    # None: the engine's dtype with --from-engine, else 2 (BF16, the engine's dtype on CUDA).
    kv_bytes: int | None = Field(None, gt=0)
    weight_bytes: int | None = Field(None, ge=0)  # None: parameter count x kv_bytes (model_shape.py says why)


def _model_kind(value: Any) -> str:
    return "named" if isinstance(value, dict) and "name" in value else "explicit"


ModelSpec = Annotated[
    Annotated[ExplicitModel, Tag("explicit")] | Annotated[NamedModel, Tag("named")], Discriminator(_model_kind)
]


class Gpu(Strict):
    memory_gb: float = Field(gt=0)  # decimal GB, as vendors advertise it
    runtime_reserve_bytes: int = Field(0, ge=0)  # allocator, CUDA graphs, activations: never KV


class MixEntry(Strict):
    name: str = Field(min_length=1)
    share: float = Field(gt=0, le=1)
    p95_input: int = Field(ge=0)
    p95_output: int = Field(gt=0)

    @property
    def context_tokens(self) -> int:
        return self.p95_input + self.p95_output


class Arrivals(Strict):
    rate_per_s: float = Field(gt=0)
    mean_service_s: float = Field(gt=0)  # admission to last token, at the load being planned
    max_wait_s: float = Field(gt=0)  # the mean queue wait the fleet must stay under


class Workload(Strict):
    """Invariants once validated: at least one mix entry, names unique, shares summing to 1, 0 <= margin < 1."""

    model: ModelSpec
    gpu: Gpu | None = None  # required unless the pool comes from a live engine (--from-engine)
    margin: float = Field(ge=0, lt=1)
    streams: int = Field(gt=0)  # peak concurrent streams
    mix: list[MixEntry] = Field(min_length=1)
    arrivals: Arrivals | None = None

    @model_validator(mode="after")
    def _mix_adds_up(self) -> Workload:
        names = [entry.name for entry in self.mix]
        if duplicated := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"mix: names must be unique, repeated: {', '.join(duplicated)}")
        total = math.fsum(entry.share for entry in self.mix)
        if abs(total - 1.0) > SHARE_TOLERANCE:
            raise ValueError(f"mix: shares must sum to 1, they sum to {total:g}")
        return self


def load_workload(path: str | Path) -> Workload:
    """The validated workload in ``path``; a `PlanError` naming the file and the key otherwise."""
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except OSError as exc:
        raise PlanError(f"{path}: cannot read: {exc.strerror}") from None
    except ValueError as exc:  # a duplicate key (ConfigError)
        raise PlanError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise PlanError(f"{path}: invalid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise PlanError(f"{path}: expected a mapping at the top level")
    try:
        return Workload.model_validate(raw)
    except ValidationError as exc:
        raise PlanError(f"{path}: {format_validation_error(exc)}") from None
