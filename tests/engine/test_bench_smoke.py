"""The engine benchmarks still run: each one's ``--smoke`` mode (toy sizes), as its own process.

The figures mean nothing here; the point is that a run of the real benchmark (on a GPU, or minutes of CPU)
does not die on a renamed option or a changed engine API after the time has already been spent.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from support import ROOT
from support.processes import run_command

pytest.importorskip("triton")


def run_smoke(script: str, *args: object) -> str:
    result = run_command(sys.executable, ROOT / "bench" / script, "--smoke", *args, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SMOKE RUN" in result.stdout
    return result.stdout


def test_engine_throughput_smoke(tmp_path: Path) -> None:
    """The engine runs first (``--hf skip``), every nested configuration with them; transformers in a later
    run fills in the same rows (``--hf only``), as bench/gpu_round.sh runs them on a GPU."""
    report_path, checkpoints = tmp_path / "report.json", tmp_path / "checkpoints"
    common = ("--json", report_path, "--checkpoint-dir", checkpoints)
    out = run_smoke("engine_throughput.py", *common, "--hf", "skip", "--kernel-profile", "2",
                    "--async-scheduling", "both", "--unfused", "--fusion-check", "3")
    for model in ("qwen2.5-0.5b", "llama-3.2-1b"):
        row = next(line for line in out.splitlines() if line.startswith(f"{model}-smoke ") and "as shipped" in line)
        assert "67 output tokens" in row and row.split()[2:4] == ["-", "-"]  # no transformers yet
        assert any(line.split()[:2] == [f"{model}-smoke", "all"] for line in out.splitlines())  # the phases
        assert f"{model}-smoke: top " in out  # the kernel profile's title
    engine_only = json.loads(report_path.read_text())
    assert all(r["hf_tokens_per_s"] is None and r["ratio"] is None for r in engine_only["results"])
    out = run_smoke("engine_throughput.py", *common, "--hf", "only", "--hf-requests", "5")
    assert sorted(p.name for p in checkpoints.iterdir()) == [  # written once, read by both runs
        "llama-3.2-1b-smoke-float32", "qwen2.5-0.5b-smoke-float32"]
    # The raw report the GPU round brings back, in its shape.
    report = json.loads(report_path.read_text())
    assert isinstance(report["device"], str) and report["peak_bandwidth_gbps"] > 0
    assert [r["model"] for r in report["results"]] == ["qwen2.5-0.5b-smoke", "llama-3.2-1b-smoke"]
    for result, before in zip(report["results"], engine_only["results"], strict=True):
        assert result["engine_tokens_per_s"] == before["engine_tokens_per_s"]  # filled in, not run again
        assert result["workload"]["num_requests"] == 8 and result["output_tokens"] == 67
        assert result["engine_tokens_per_s"] > 0 and result["hf_tokens_per_s"] > 0 and result["hf_requests"] == 5
        assert result["ratio"] == pytest.approx(result["engine_tokens_per_s"] / result["hf_tokens_per_s"])
        assert 0 < result["decode_mbu"] and result["decode_mbu_batch_ge_64"] is None  # no batch of 64 in 8
        check_nested(result)
        check_phases(result)
        check_kernels(result)


def check_nested(result: dict) -> None:
    """The engine as shipped on top; the other scheduling and the unfused run nested, each with the requests
    that got the shipped run's tokens (on a CPU, in fp32: every one); which scheduling was faster."""
    assert result["async_scheduling"] is False and result["cuda_fusion"] is False  # the shipped default, a CPU
    other, unfused = result["other_scheduling"], result["unfused"]
    assert other["async_scheduling"] is True
    for nested in (other, unfused):
        assert nested["engine_tokens_per_s"] > 0 and nested["identical_requests"] == 8
        assert nested["steps"] >= nested["decode_only_steps"] > 0 and "phases" in nested
    assert result["async_speedup"] == pytest.approx(other["engine_tokens_per_s"] / result["engine_tokens_per_s"])
    assert result["faster_async_scheduling"] == (result["async_speedup"] > 1)
    check = result["fusion_fp32"]  # off CUDA both runs take the separate ops: the plumbing, not the kernels
    assert (check["dtype"], check["requests"], check["identical_requests"], check["applies"]) == ("float32", 3, 3, False)
    assert 3 * 4 <= check["output_tokens"] <= 3 * 12


def check_phases(result: dict) -> None:
    """The timed run's phases (bench/step_phases.py): every step timed, each group's phases adding up to its
    step time, none negative (a call counted twice would make "rest" so), and the step times within the run."""
    phases = result["phases"]
    assert phases["decode_batch_ge_64"] is None  # as for the MBU: no batch of 64 in 8 requests
    everything, prefill = phases["all"], phases["with_prefill"]
    assert everything["steps"] == result["steps"]
    assert prefill["steps"] == result["steps"] - result["decode_only_steps"] > 0
    for group in (everything, prefill):
        assert sum(group["phases_ms"].values()) == pytest.approx(group["step_ms"])
        assert min(group["phases_ms"].values()) >= 0 and group["phases_ms"]["schedule"] > 0
        assert group["model_ms"] > 0 and group["host_ms"] > 0 and group["sample_ms"] > 0
        assert group["host_ms"] + group["model_ms"] + group["sample_ms"] == pytest.approx(group["step_ms"])
    stepping_s = everything["step_ms"] * everything["steps"] / 1e3
    assert 0 <= result["outside_steps_s"] and stepping_s + result["outside_steps_s"] == pytest.approx(
        result["engine_elapsed_s"])
    assert stepping_s > 0.5 * result["engine_elapsed_s"]  # generate's own loop is not most of the run


def check_kernels(result: dict) -> None:
    """--kernel-profile 2 on a CPU: aten ops by CPU self time, largest first, from 2 steps at batch 8."""
    assert "kernel_profile_error" not in result, result.get("kernel_profile_error")
    assert (result["kernel_profile_mode"], result["kernel_profile_batch"], result["kernel_profile_steps"]) == \
        ("cpu", 8, 2)
    kernels = result["kernels"]
    assert 0 < len(kernels) <= 15 and all(k["calls"] > 0 and k["total_ms"] > 0 for k in kernels)
    assert [k["total_ms"] for k in kernels] == sorted((k["total_ms"] for k in kernels), reverse=True)
    assert 0 < sum(k["share"] for k in kernels) <= 1 + 1e-9 and any("mm" in k["name"] for k in kernels)
    assert result["kernel_ms_per_step"] * 2 >= sum(k["total_ms"] for k in kernels) - 1e-9


@pytest.mark.slow  # 11 s; test_gpu_round_dry_run (slow too) runs it at smoke size, as a GPU round would
def test_kernel_bandwidth_smoke(tmp_path: Path) -> None:
    out = run_smoke("kernel_bandwidth.py", "--tiles", "32x4", "--splits", "1x16", "--json", tmp_path / "report.json")
    assert "device-to-device copy" in out
    assert sum(line.startswith("qwen2.5-0.5b") for line in out.splitlines()) == 9  # 3 cases, 3 launches each
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["copy_gbps"] > 0 and report["cache_dtype"] == "float16"
    cases = [(2, 16), (2, 40)]
    # The engine's launch (its tile, the split count the backend picks on a CPU: 4, MIN_SPLIT_KEYS), a tile
    # swept with that split policy, and a split policy swept with the engine's tile.
    launches = ((128, 4, 4, 256, True), (32, 4, 4, 256, False), (128, 4, 1, 16, False))
    rows = report["results"]
    assert [(r["batch"], r["context"], r["block_n"], r["num_warps"], r["num_splits"], r["min_split_keys"],
             r["engine_tile"]) for r in rows[:6]] == [(*case, *launch) for case in cases for launch in launches]
    # The workload cell: contexts drawn in a range, reported by their mean.
    assert [(r["batch"], r["contexts"], r["workload_cell"]) for r in rows[6:]] == [(2, [4, 40], True)] * 3
    assert all(r["gbps"] > 0 and r["of_copy"] > 0 and r["eager_of_copy"] > 0 for r in rows)
    assert all(r["timing"] == "host" and r["copies"] == 1 for r in rows)  # no CUDA graph without CUDA


def test_lora_smoke(tmp_path: Path) -> None:
    out = run_smoke("lora.py", "--out", tmp_path / "lora.json")
    report = json.loads((tmp_path / "lora.json").read_text())
    assert "mixed / base" in out and len(report["results"]) == 2 and report["ratio_cpu"] > 0


@pytest.mark.parametrize("stubbed", [False, True], ids=["model", "model-stubbed"])
def test_step_overhead_smoke(stubbed: bool) -> None:
    out = run_smoke("step_overhead.py", *(["--model-stubbed"] if stubbed else []))
    (row,) = [line.split() for line in out.splitlines() if line.startswith("    4 ")]
    step_ms, host_ms = float(row[1]), float(row[2])
    phases = [float(value) for value in row[4:11]]
    assert 0 < host_ms < step_ms and min(phases) >= 0  # host: every phase but the model's
    assert ("(stubbed: host work alone)" in out) == stubbed
    if stubbed:  # the stand-in forward returns zeros: a step is its host work, the model a sliver of it
        assert phases[2] < host_ms, row  # unstubbed, the tiny forward alone is several times the host work


def test_prefill_tiles_smoke(tmp_path: Path) -> None:
    out = run_smoke("prefill_tiles.py", "--tiles", "32x32x4", "--json", tmp_path / "report.json")
    assert sum(line.startswith("qwen2.5-0.5b") for line in out.splitlines()) == 4  # 2 cases, 2 tiles each
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(r["seqs"], r["chunk"], r["prefix"], r["tile"], r["engine_tile"]) for r in report["results"]] == [
        (*case, tile, engine) for case in ((2, 8, 0), (1, 8, 24))
        for tile, engine in (([128, 64, 8], True), ([32, 32, 4], False))]
    assert all(r["tflops"] > 0 for r in report["results"]), "a swept tile computed what the default does"


@pytest.mark.slow
def test_cpu_real_model_smoke() -> None:
    """The real model on both sides (loading it is most of the minute this takes), a few tiny requests.
    In ``make test-slow``: transformers' GGUF load alone takes 20-50 s here, and the SmolLM2 parity tests
    already load the same model in both the engine and transformers in ``make test``."""
    out = run_smoke("cpu_real_model.py")
    for row in ("batch, useful output tokens/s", "single-stream decode tokens/s"):
        assert next(line for line in out.splitlines() if line.startswith(row)).endswith("x")
    assert "model forward" in out and "sampling" in out  # the profile's parts


@pytest.mark.slow
def test_gpu_round_dry_run(tmp_path: Path) -> None:
    """bench/gpu_round.sh's plumbing on the CPU (``DRY_RUN=1``: every step at --smoke size, the GPU tests
    collected, not run): each step ends with exit 0, and the reports and the summary come back in $OUT.
    Slow (1.5 minutes on two cores): the GPU round is prepared rarely and run by hand."""
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path / "out"), "CKPT": str(tmp_path / "checkpoints"),
           "PYTHON": sys.executable}
    result = run_command("bash", ROOT / "bench" / "gpu_round.sh", env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    exits = [line.rsplit(": ", 1)[1] for line in result.stdout.splitlines() if ": exit " in line]
    assert exits == ["exit 0"] * 7, result.stdout
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "engine_throughput.json", "kernel_bandwidth.json", "log.txt", "summary.txt", "tests.txt"]
    report = json.loads((out / "engine_throughput.json").read_text())
    assert [r["model"] for r in report["results"]] == ["qwen2.5-0.5b-smoke", "llama-3.2-1b-smoke", "llama-3.1-8b-smoke"]
    assert [r["hf_tokens_per_s"] is not None for r in report["results"]] == [True, True, False]  # 8B: engine only
    assert "other_scheduling" in report["results"][0] and "kernels" in report["results"][0]
    summary = (out / "summary.txt").read_text()
    assert "Llama-3.1-8B shape, decode MBU at batch 64" in summary and "llama-3.1-8b-smoke: " in summary
