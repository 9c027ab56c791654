"""Open a GGUF file with llama.cpp's own reader (the ``gguf`` package) and read its metadata strictly.

Every failure is a one-line `ModelLoadError` naming the file: a file that does not start with the GGUF magic
is "not a GGUF file"; one that does but that the reader cannot parse (it memory-maps the file and fails on
the first header, array or tensor that runs past the end) is "truncated or corrupt". Metadata reads say
which key is missing or has the wrong type, as `config.json` errors name their field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFReader, GGUFValueType, ReaderField

from engine.model.errors import ModelLoadError
from engine.prompting.gguf_reader import PlainArrayReader

GGUF_MAGIC = b"GGUF"
_INTEGER_TYPES = frozenset({
    GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16, GGUFValueType.UINT32,
    GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64,
})
_NUMBER_TYPES = _INTEGER_TYPES | {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}
_MISSING = object()  # sentinel: a key without a default


def open_gguf(path: Path) -> GGUFReader:
    """The reader of ``path``, its header, metadata and tensor index parsed (tensor data stays mapped)."""
    try:
        with path.open("rb") as handle:
            magic = handle.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    try:
        return PlainArrayReader(path)
    except Exception as exc:  # noqa: BLE001 - the reader raises whatever numpy raises on short or bad data
        size = path.stat().st_size
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file ({size} bytes): {exc}") from None


@dataclass(slots=True, frozen=True)
class GGUFMetadata:
    """Typed access to a GGUF file's key-value metadata; every error names the file and the key."""

    path: Path
    fields: Mapping[str, ReaderField]

    def error(self, key: str, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: metadata '{key}' {problem}")

    def has(self, key: str) -> bool:
        return key in self.fields

    def _get(self, key: str, default: Any, types: frozenset[GGUFValueType], expected: str) -> Any:
        field = self.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise self.error(key, "is missing")
            return default
        if not field.types or field.types[0] not in types:
            names = "/".join(t.name for t in field.types)
            raise self.error(key, f"must be {expected}, got a value of type {names}")
        try:
            return field.contents()
        except ValueError as exc:  # a string that is not UTF-8
            raise self.error(key, f"cannot be decoded: {exc}") from None

    def positive_int(self, key: str, default: int | object = _MISSING) -> int:
        value = self._get(key, default, _INTEGER_TYPES, "an integer")
        if value <= 0:
            raise self.error(key, f"must be a positive integer, got {value}")
        return value

    def positive_float(self, key: str, default: float | object = _MISSING) -> float:
        value = float(self._get(key, default, _NUMBER_TYPES, "a number"))
        if not math.isfinite(value) or value <= 0:
            raise self.error(key, f"must be a positive number, got {value}")
        return value

    def string(self, key: str, default: str | object = _MISSING) -> str:
        return self._get(key, default, frozenset({GGUFValueType.STRING}), "a string")
