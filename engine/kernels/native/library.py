"""Build, choose and load the native CPU kernels (the C sources beside this file), once per process.

The sources are written once against simd.h's sixteen-lane vectors and built per target:

========  ====================================  =========================================================
target    flags                                 runs on
========  ====================================  =========================================================
avx512    -march=x86-64-v4 -mavx512vnni         AVX-512 F/BW/VL + VNNI (Ice Lake and later, Zen 4)
avx2      -march=x86-64-v3                      AVX2 + FMA + F16C (Haswell and later, every Zen)
generic   -march=x86-64 (none off x86)          any CPU: plain C loops, the reference the others equal
========  ====================================  =========================================================

Every target computes the same bits (simd.h says why), so the choice changes speed, never results. At
first use ``kernels()`` builds the plain C library (it loads anywhere) to ask the CPU which target it runs,
builds that one and loads it: the best of avx512 and avx2 (generic is slower than torch's own kernels, so
it serves only as the reference of tests/engine/test_native_kernels.py). ``status()`` says which path is
in use and why; the engine logs it at start-up and reports it in its telemetry (``native_path``,
``native_reason``). The native path is off, with its reason, where there is no C compiler, a build fails
(the reason holds the compiler's first error line), the CPU has neither target, or ``KVGUARD_NATIVE=0``.
``KVGUARD_NATIVE_TARGET=avx2|avx512|generic`` asks for one target (to compare them; one the CPU cannot run
is refused with its reason).

Builds are cached under ``$KVGUARD_CACHE`` (default ``~/.cache/kvguard``), keyed by the sources' and flags'
hash, and written to a temporary name and renamed, so processes building at once never load half a file.
Plain C, no torch headers: a build takes about a second with Debian's build-essential.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.kernels.native import layout
from engine.kernels.native.ops import NativeKernels

HERE = Path(__file__).parent
SOURCES = tuple(HERE / name for name in ("q4_matmul.c", "int8_matmul.c", "decode_step.c", "target.c"))
HEADERS = tuple(HERE / name for name in ("simd.h", "kernels.h"))
# No contraction of a * b + c into fma where the C writes two operations (simd.h: every target rounds the
# same), no -ffast-math; OpenMP is the process's own libgomp (torch's), so torch.set_num_threads applies.
COMMON_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-fno-fast-math")
_X86 = platform.machine() in ("x86_64", "AMD64")
# target -> (simd.h's KVG_ISA, its flags)
TARGETS: dict[str, tuple[int, tuple[str, ...]]] = {
    "generic": (0, ("-march=x86-64",) if _X86 else ()),
    "avx2": (1, ("-march=x86-64-v3",)),
    "avx512": (2, ("-march=x86-64-v4", "-mavx512vnni")),
}
_NAMES = {isa: name for name, (isa, _) in TARGETS.items()}
_REASONS = {"avx512": "the CPU has AVX-512 VNNI", "avx2": "AVX2 + FMA; the CPU has no AVX-512 VNNI"}


class BuildError(OSError):
    """The native library could not be built; ``str()`` is one line that says why."""


@dataclass(frozen=True)
class NativeStatus:
    """Which native path this process takes: ``path`` is a target name or ``off``; ``reason`` says why."""

    path: str
    reason: str

    @property
    def on(self) -> bool:
        return self.path != "off"


def build(target: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """The shared object of ``target`` (built now unless cached); ``extra_flags`` come after the target's
    own (the spread table in docs/benchmarks/cpu-numerics.md builds ``generic`` for other -march values)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise BuildError(f"no C compiler ({os.environ.get('CC', 'cc')} not found)")
    isa, flags = TARGETS[target]
    command_flags = (*COMMON_FLAGS, *flags, f"-DKVG_ISA={isa}", *extra_flags)
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES + HEADERS))
    digest.update(" ".join((compiler, *command_flags)).encode())
    cache = Path(os.environ.get("KVGUARD_CACHE", Path.home() / ".cache" / "kvguard"))
    built_file = cache / f"kvguard_cpu_kernels-{target}-{digest.hexdigest()[:16]}.so"
    if built_file.exists():
        return built_file
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:
        scratch_file = Path(scratch) / built_file.name
        try:
            subprocess.run([compiler, *command_flags, *map(str, SOURCES), "-o", str(scratch_file), "-lm"],
                           check=True, capture_output=True, text=True, timeout=120)
        except subprocess.CalledProcessError as error:
            raise BuildError(f"build failed: {_first_error(error.stderr)}") from None
        except subprocess.TimeoutExpired:
            raise BuildError("build failed: the compiler ran over 120 s") from None
        os.replace(scratch_file, built_file)
    return built_file


def _first_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["the compiler gave no output"])[0]


def load(target: str, extra_flags: tuple[str, ...] = ()) -> NativeKernels:
    """``target``'s library. The caller makes sure the CPU runs it."""
    library = ctypes.CDLL(str(build(target, extra_flags)))
    p, i = ctypes.c_void_p, ctypes.c_int
    for name, arguments in (("q4_matmul", [p, i, i, p, p, i, p]), ("int8_matmul", [p, i, i, p, p, i, p]),
                            ("decode_step", [p, p, i, p, p, p, i, p]), ("decode_layout", [p, i])):
        function = getattr(library, name)
        function.argtypes, function.restype = arguments, ctypes.c_int
    library.rms_norm.argtypes, library.rms_norm.restype = [p, p, ctypes.c_float, i, i, p], None
    return NativeKernels(target, library)


@functools.cache
def best_target() -> str | None:
    """The fastest target this CPU runs (None: neither avx512 nor avx2), asked of the plain C build."""
    return _NAMES[load("generic").c.kvg_cpu_best_isa()] if _X86 else None


def runs(target: str) -> bool:
    """Whether this CPU runs ``target``'s build (every CPU runs ``generic``)."""
    best = best_target()
    return target == "generic" or (best is not None and TARGETS[target][0] <= TARGETS[best][0])


@functools.cache
def _chosen() -> tuple[NativeKernels | None, NativeStatus]:
    if os.environ.get("KVGUARD_NATIVE", "1") == "0":
        return None, NativeStatus("off", "KVGUARD_NATIVE=0")
    asked = os.environ.get("KVGUARD_NATIVE_TARGET")
    if asked is not None and asked not in TARGETS:
        return None, NativeStatus("off", f"KVGUARD_NATIVE_TARGET={asked!r} is not one of {', '.join(TARGETS)}")
    try:
        best = best_target()
        if asked is not None:
            if not runs(asked):
                return None, NativeStatus("off", f"KVGUARD_NATIVE_TARGET={asked}: this CPU does not run it")
            chosen, reason = asked, f"KVGUARD_NATIVE_TARGET={asked}"
        elif best is None:
            return None, NativeStatus("off", "the CPU has neither AVX-512 VNNI nor AVX2 + FMA")
        else:
            chosen, reason = best, _REASONS[best]
        loaded = load(chosen)
        layout.check(loaded.c)  # a struct changed on one side only: off, with the difference as the reason
        return loaded, NativeStatus(chosen, reason)
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        return None, NativeStatus("off", str(error).splitlines()[0] if str(error) else type(error).__name__)


def library() -> NativeKernels | None:
    """The library this process uses, or None where the native path is off (``status()`` says why)."""
    return _chosen()[0]


def status() -> NativeStatus:
    return _chosen()[1]
