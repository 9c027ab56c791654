"""The native 4-bit matmul (q4_kernel.c) and decode step (decode_step.c): one library, built once per machine
with the C compiler, loaded with ctypes.

Plain C with AVX-512 VNNI intrinsics and no torch headers, so it compiles in about a second with Debian's
build-essential; the shared object is cached under ``$KVGUARD_CACHE`` (default ``~/.cache/kvguard``), keyed
by the sources' hash, and written to a temporary name and renamed, so processes building at once never load
half a file. ``available()`` is False where there is no compiler, the build fails, or the CPU lacks AVX-512
VNNI: the int4 format then uses torch's own kernel (weights.Int4Linear), and nothing else changes.
``KVGUARD_Q4_NATIVE=0`` turns it off (to compare the two).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(name) for name in ("q4_kernel.c", "decode_step.c", "int8_kernel.c")]
HEADERS = [Path(__file__).with_name("q4_kernel.h")]
TILE = 16  # output rows per tile (one AVX-512 register of float32)
GROUP = 32  # inputs per scale and zero
# No contraction of a * b + c into fma where the C is written as two operations: decode_step.c's RoPE then
# rounds as torch's separate multiply and add do (the kernels' fma are explicit intrinsics, unaffected).
_FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off"]


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("KVGUARD_Q4_NATIVE", "1") == "0":
        return None
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.SubprocessError):
        return None
    if not library.q4_supported():
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    library.q4_matmul.argtypes = [p, i, i, p, p, i, p]
    library.q4_matmul.restype = None
    library.rms_norm.argtypes = [p, p, ctypes.c_float, i, i, p]
    library.rms_norm.restype = None
    library.decode_step.argtypes = [p, p, i, p, p, p, i, p]
    library.decode_step.restype = ctypes.c_int
    library.int8_matmul.argtypes = [p, i, i, p, p, i, p]
    library.int8_matmul.restype = ctypes.c_int
    return library


def _build() -> Path:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise OSError("no C compiler")
    sources = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(sources + " ".join(_FLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("KVGUARD_CACHE", Path.home() / ".cache" / "kvguard"))
    target = cache / f"q4_kernel-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([compiler, *_FLAGS, *map(str, SOURCES), "-o", str(built)], check=True,
                       capture_output=True, timeout=120)
        os.replace(built, target)
    return target


def available() -> bool:
    return _library() is not None


def fits(out_features: int, in_features: int) -> bool:
    return out_features % TILE == 0 and in_features % GROUP == 0


def pack(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_kernel.c's layout from ``W[n, k] = scale[n, g] * q[n, k] + low[n, g]`` (``q`` integers 0..15
    ``[N, K]``; ``scale``, ``low`` ``[N, K / 32]``): ``(qpack uint8 [N/16, K/8, 64], scales fp16 [N/16,
    K/32, 2, 16])``."""
    n, k = q.shape
    q = q.to(torch.uint8).view(n // TILE, TILE, k // 8, 2, 4)  # (tile, row, octet, half, byte)
    qpack = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    scales = torch.stack((scale, low), dim=1).to(torch.float16)  # [N, 2, G]
    scales = scales.view(n // TILE, TILE, 2, k // GROUP).permute(0, 3, 2, 1).contiguous()
    return qpack.view(n // TILE, k // 8, 64), scales


def unpack(qpack: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``W [N, K]`` in ``dtype``: ``pack``'s inverse."""
    tiles, octets, _ = qpack.shape
    nibbles = qpack.view(tiles, octets, TILE, 4)
    q = torch.stack((nibbles & 15, nibbles >> 4), dim=3)  # (tile, octet, row, half, byte)
    q = q.permute(0, 2, 1, 3, 4).reshape(tiles * TILE, octets * 8 // GROUP, GROUP).to(dtype)
    sz = scales.to(dtype).permute(0, 3, 2, 1).reshape(tiles * TILE, 2, -1)  # [N, 2, G]
    return torch.addcmul(sz[:, 1, :, None], q, sz[:, 0, :, None]).reshape(tiles * TILE, octets * 8)


def matmul(x: torch.Tensor, qpack: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ W^T`` in float32 (``x`` is made float32 and contiguous first)."""
    x = x.float().contiguous()
    rows, k = x.shape
    n = qpack.shape[0] * TILE
    out = torch.empty(rows, n, dtype=torch.float32)
    _library().q4_matmul(x.data_ptr(), rows, k, qpack.data_ptr(), scales.data_ptr(), n, out.data_ptr())
    return out


# int8_kernel.c takes up to 8 rows, but pays off only at one: SmolLM2's LM head (49152 x 576), against
# torch's weight-only kernel on bfloat16 activations, best of 20: one row 4.11 vs 4.94 ms at one thread, 2.33
# vs 2.46 at two (both read the 28 MB at memory speed), 4 rows 8.76 vs 7.02 and 11.7 vs 10.0 ms (a float
# reduction per row and output). Its error against the exact product: 2e-5 of the largest output, torch's 5e-3.
INT8_ROWS = 1


def int8_fits(rows: int, in_features: int) -> bool:
    """Whether ``int8_matmul`` takes this product: one row, inputs a multiple of 64 up to 1024."""
    return rows <= INT8_ROWS and in_features % 64 == 0 and in_features <= 1024


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``(x [M, K] @ qweight^T) * scales`` in float32 (int8_kernel.c: ``qweight`` int8 ``[N, K]``, ``scales``
    float32 ``[N]``, both contiguous; ``int8_fits(M, K)``)."""
    x = x.float().contiguous()
    rows, k = x.shape
    out = torch.empty(rows, qweight.shape[0], dtype=torch.float32)
    if _library().int8_matmul(x.data_ptr(), rows, k, qweight.data_ptr(), scales.data_ptr(), qweight.shape[0],
                              out.data_ptr()):
        raise MemoryError("int8_matmul: could not allocate its scratch memory")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension, float32 and contiguous on the CPU."""
    out = torch.empty_like(x)
    k = x.shape[-1]
    _library().rms_norm(x.data_ptr(), weight.data_ptr(), eps, x.numel() // k, k, out.data_ptr())
    return out
