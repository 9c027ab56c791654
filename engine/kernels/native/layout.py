"""decode_step.c's structs as ctypes sees them. The C side says how its compiler lays them out
(``decode_layout``); ``check`` holds the two together, and tests/engine/test_native_kernels.py calls it for
every target the CPU runs."""

from __future__ import annotations

import ctypes

_P = ctypes.c_void_p


class Q4Weight(ctypes.Structure):
    _fields_ = [("q", _P), ("s", _P)]


class DecodeLayer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("qkv", Q4Weight), ("o", Q4Weight), ("gate_up", Q4Weight),
                ("down", Q4Weight), ("kv_cache", _P)]


class DecodeModel(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int), ("hidden", ctypes.c_int), ("heads", ctypes.c_int),
                ("kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int), ("intermediate", ctypes.c_int),
                ("block_size", ctypes.c_int), ("cache_slots", ctypes.c_int64), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("cos", _P), ("sin", _P), ("layer", ctypes.POINTER(DecodeLayer))]


def python_layout() -> list[int]:
    """Sizes and offsets in decode_layout's order: each struct's size, then its fields' offsets."""
    numbers: list[int] = []
    for struct in (Q4Weight, DecodeLayer, DecodeModel):
        numbers.append(ctypes.sizeof(struct))
        numbers.extend(getattr(struct, name).offset for name, _ in struct._fields_)
    return numbers


def c_layout(library: ctypes.CDLL) -> list[int]:
    room = 64
    out = (ctypes.c_int64 * room)()
    count = library.decode_layout(out, room)
    return list(out[:count])


def check(library: ctypes.CDLL) -> None:
    """Raise if ctypes and the C compiler lay the structs out differently (a field added on one side only)."""
    python, c = python_layout(), c_layout(library)
    if python != c:
        raise RuntimeError(f"decode_step.c's structs and layout.py disagree: C {c}, ctypes {python}")
