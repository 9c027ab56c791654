"""The engine benchmarks still run: each one's ``--smoke`` mode (toy sizes), as its own process.

The figures mean nothing here; the point is that a run of the real benchmark (on a GPU, or minutes of CPU)
does not die on a renamed option or a changed engine API after the time has already been spent.
"""

from __future__ import annotations

import sys

import pytest
from support import ROOT
from support.processes import run_command

pytest.importorskip("triton")


def run_smoke(script: str) -> str:
    result = run_command(sys.executable, ROOT / "bench" / script, "--smoke", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SMOKE RUN" in result.stdout
    return result.stdout


def test_engine_throughput_smoke() -> None:
    out = run_smoke("engine_throughput.py")
    for model in ("qwen2.5-0.5b", "llama-3.2-1b"):
        row = next(line for line in out.splitlines() if line.startswith(f"{model}-smoke-shaped"))
        assert "67 output tokens" in row and "x" in row.split()[3]


def test_kernel_bandwidth_smoke() -> None:
    out = run_smoke("kernel_bandwidth.py")
    assert "device-to-device copy" in out
    assert sum(line.startswith("qwen2.5-0.5b") for line in out.splitlines()) == 4


def test_step_overhead_smoke() -> None:
    out = run_smoke("step_overhead.py")
    (row,) = [line.split() for line in out.splitlines() if line.startswith("    4 ")]
    step_ms, host_ms = float(row[1]), float(row[2])
    phases = [float(value) for value in row[4:11]]
    assert 0 < host_ms < step_ms and min(phases) >= 0  # host: every phase but the model's


@pytest.mark.slow
def test_cpu_real_model_smoke() -> None:
    """The real model on both sides (loading it is most of the minute this takes), a few tiny requests.
    In ``make test-slow``: transformers' GGUF load alone takes 20-50 s here, and the SmolLM2 parity tests
    already load the same model in both the engine and transformers in ``make test``."""
    out = run_smoke("cpu_real_model.py")
    for row in ("batch, useful output tokens/s", "single-stream decode tokens/s"):
        assert next(line for line in out.splitlines() if line.startswith(row)).endswith("x")
    assert "model forward" in out and "sampling" in out  # the profile's parts
