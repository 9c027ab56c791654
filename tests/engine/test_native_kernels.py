"""The native CPU kernels (engine/kernels/native) compute the same bits on every target and CPU, and the
engine says which path it took and why.

simd.h specifies every lane operation (one IEEE rounding each, fused where it says fmadd) and one
horizontal-sum tree, so the plain C build is the reference the vector builds must equal bit for bit: every
target this CPU runs is compared with it on the int4 and int8 products, RMSNorm and a whole decode step, and
so is the plain C build compiled for newer -march values (the compiler may vectorize it, never reorder it).
A target this CPU cannot run is built (the build must succeed anywhere) but not run here; the spread table
in docs/benchmarks/cpu-numerics.md says where each ran.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from support import ROOT
from support.native_model import decode_inputs, random_int4_model

from engine import LLM
from engine.kernels.native import layout, library, q4
from engine.kernels.native.ops import NativeKernels
from engine.model.native_decode import NativeDecoder
from engine.model.native_path import bind
from engine.model.weights import quantize_int8, quantize_q4

# (target, extra flags): the runtime targets, then the reference compiled for newer instruction sets.
BUILDS = [("avx512", ()), ("avx2", ()), ("generic", ("-march=x86-64-v3",)), ("generic", ("-march=x86-64-v4",))]
NEEDS = {"-march=x86-64-v3": "avx2", "-march=x86-64-v4": "avx512"}
# The random int4 model's projections are native Q4Linear: they exist only while the native path is on.
NEEDS_ON = pytest.mark.skipif(library.library() is None, reason=f"native path off: {library.status().reason}")
SWITCHES = ("KVGUARD_NATIVE", "KVGUARD_NATIVE_TARGET", "KVGUARD_NATIVE_DECODE", "CC", "KVGUARD_CACHE")


def runnable(target: str, flags: tuple[str, ...]) -> bool:
    return all(library.runs(NEEDS.get(flag, "generic")) for flag in flags) and library.runs(target)


@pytest.fixture(scope="module")
def reference() -> NativeKernels:
    return library.load("generic")


@pytest.fixture(scope="module")
def model():
    return random_int4_model()


def outputs(kernels: NativeKernels, model) -> dict[str, torch.Tensor]:
    """Every kernel on fixed random inputs: products with 1, 5 and 9 rows (the tiles' fours and the rest), an
    outlier input, RMSNorm with a tail past the sixteen lanes, and a decode step of three unequal sequences."""
    generator = torch.Generator().manual_seed(0)
    results = {}
    for rows, n, k in [(1, 64, 64), (5, 128, 96), (9, 48, 256)]:
        qpack, scales = q4.pack(*quantize_q4(torch.randn(n, k, generator=generator) * 0.05))
        x = torch.randn(rows, k, generator=generator)
        x[0, 3] = 40.0
        results[f"q4 {rows}x{k}"] = kernels.q4_matmul(x, qpack, scales)
        qweight, row_scales = quantize_int8(torch.randn(80, 128, generator=generator))
        results[f"int8 {k}"] = kernels.int8_matmul(torch.randn(1, 128, generator=generator), qweight, row_scales)
        results[f"norm {k}"] = kernels.rms_norm(torch.randn(rows, k + 5, generator=generator),
                                                torch.randn(k + 5, generator=generator), 1e-6)
    hidden, positions, caches, meta = decode_inputs(model, [5, 16, 40])
    with torch.inference_mode():
        results["decode"] = NativeDecoder(model.model, kernels).run(hidden, positions, caches, meta)
    results["decode caches"] = torch.stack(caches)
    return results


@NEEDS_ON
@pytest.mark.parametrize(("target", "flags"), BUILDS, ids=[" ".join((t, *f)) for t, f in BUILDS])
def test_every_build_computes_the_reference_bits(reference: NativeKernels, model, target: str,
                                                  flags: tuple[str, ...]) -> None:
    built = library.build(target, flags)  # builds anywhere: a compile error fails here on every machine
    assert built.exists()
    if not runnable(target, flags):
        pytest.skip(f"built; this CPU does not run {target} {' '.join(flags)} (best: {library.best_target()})")
    kernels = library.load(target, flags)
    layout.check(kernels.c)
    assert kernels.c.kvg_isa() == library.TARGETS[target][0]
    expected, got = outputs(reference, model), outputs(kernels, model)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), f"{target} {' '.join(flags)}: {name} differs from plain C"


def test_the_structs_layout_is_the_compilers(reference: NativeKernels) -> None:
    """layout.py mirrors decode_step.c's structs: the compiler's sizes and offsets equal ctypes'; a field
    added on one side only would fail here (and turn the native path off with the difference as reason)."""
    assert layout.c_layout(reference.c) == layout.python_layout()
    assert len(layout.python_layout()) == 3 + 8 + 14  # sizes and fields of Q4Weight, DecodeLayer, DecodeModel


def status_in_fresh_process(env: dict[str, str]) -> dict[str, str]:
    """``library.status()`` in a new interpreter (the choice is made once per process) with ``env`` set and
    this process's own native switches left out."""
    code = "import json; from engine.kernels.native import library as l; s = l.status(); " \
           "print(json.dumps({'path': s.path, 'reason': s.reason}))"
    inherited = {name: value for name, value in os.environ.items() if name not in SWITCHES}
    done = subprocess.run([sys.executable, "-c", code], env={**inherited, **env}, cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(done.stdout)


def test_the_path_says_why_it_is_off(tmp_path) -> None:
    """Turned off by env, an unknown target asked for, and a compiler that fails: each is ``off`` with its
    reason, the last with the compiler's first error line (a failed build is never silent)."""
    assert status_in_fresh_process({"KVGUARD_NATIVE": "0"}) == {"path": "off", "reason": "KVGUARD_NATIVE=0"}
    unknown = status_in_fresh_process({"KVGUARD_NATIVE_TARGET": "neon"})
    assert unknown["path"] == "off" and "'neon' is not one of generic, avx2, avx512" in unknown["reason"]
    broken = tmp_path / "cc"  # the real compiler, made to fail as a broken toolchain would
    broken.write_text('#!/bin/sh\nexec gcc -include /nonexistent/kvguard.h "$@"\n')
    broken.chmod(0o755)
    failed = status_in_fresh_process({"CC": str(broken), "KVGUARD_CACHE": str(tmp_path / "cache")})
    assert failed["path"] == "off"
    assert failed["reason"].startswith("build failed: ") and "/nonexistent/kvguard.h" in failed["reason"]
    missing = status_in_fresh_process({"CC": str(tmp_path / "no-such-cc"), "KVGUARD_CACHE": str(tmp_path / "c2")})
    assert missing == {"path": "off", "reason": f"no C compiler ({tmp_path / 'no-such-cc'} not found)"}


def test_the_engine_logs_and_reports_its_path(caplog: pytest.LogCaptureFixture) -> None:
    """The start-up log line and the telemetry fields name the path and why (the tiny model is fp32, so the
    decode step stays on torch and says so)."""
    with caplog.at_level("INFO", logger="engine.core"):
        llm = LLM(model="tiny", num_blocks=16, max_num_seqs=2)
    status = library.status()
    line = f"native CPU kernels: {status.path} ({status.reason}; decode step off ("
    assert any(record.getMessage().startswith(line) for record in caplog.records), caplog.text
    snapshot = llm.telemetry()
    assert snapshot.native_path == status.path
    assert snapshot.native_reason.startswith(status.reason) and "decode step off" in snapshot.native_reason


def test_a_target_the_cpu_cannot_run_is_refused() -> None:
    """Asking for a target this CPU cannot run leaves the path off and says so (where every target runs,
    the request is honoured instead)."""
    target = "avx512" if not library.runs("avx512") else "avx2" if not library.runs("avx2") else None
    if target is None:
        assert status_in_fresh_process({"KVGUARD_NATIVE_TARGET": "avx2"}) == \
            {"path": "avx2", "reason": "KVGUARD_NATIVE_TARGET=avx2"}
        return
    assert status_in_fresh_process({"KVGUARD_NATIVE_TARGET": target}) == \
        {"path": "off", "reason": f"KVGUARD_NATIVE_TARGET={target}: this CPU does not run it"}


@NEEDS_ON
def test_a_deep_copy_shares_the_kernels_and_drops_the_decoder(model) -> None:
    """A copied model's weights live elsewhere: it keeps the (process-wide) kernels but not the decoder,
    whose pointers are into the original, until it is bound itself."""
    duplicate = copy.deepcopy(model)
    assert duplicate.model.native is None and duplicate.model.norm.native is model.model.norm.native
    bind(duplicate)
    assert duplicate.model.native is not None and duplicate.model.native is not model.model.native
