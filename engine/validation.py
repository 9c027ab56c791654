"""The one way the engine reports bad input: ``ValueError("<field>: must be <expected>, got <value>")``."""

from __future__ import annotations


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def require(ok: bool, field: str, expected: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{field}: must be {expected}, got {value!r}")
