"""The routing benchmark (bench/routing.py) still runs: its ``--quick`` mode as its own process, and its
report's shape. A toy workload on a shared machine says nothing about the policies, so no figure is judged:
what is checked is that every policy ran the whole workload, was measured and was drawn."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support.processes import run_command

POLICIES = ["round_robin", "least_loaded", "prefix", "kvguard"]
TTFT_FIGURES = {"n", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms"}


@pytest.mark.slow  # three engines and four guards to start; tests/guard/test_pool_routing.py checks the policies in make test
def test_routing_quick(tmp_path: Path) -> None:
    done = run_command(sys.executable, "-m", "bench.routing", "--quick", "--out", tmp_path, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "QUICK RUN" in done.stdout
    report = json.loads((tmp_path / "routing.json").read_text())
    assert report["quick"] is True and report["benchmark"] == "routing" and report["machine"]
    assert list(report["runs"]) == POLICIES
    for policy, run in report["runs"].items():
        assert run["outcomes"] == {"completed": report["requests_per_policy"]}, policy
        assert 0 < run["hit_ratio"] < 1 and run["query_tokens"] > 0, policy
        assert set(run["ttft"]) == TTFT_FIGURES and run["output_tokens_per_s"] > 0, policy
        assert isinstance(run["preemptions"], int)
        assert list(run["replicas"]) == ["e0", "e1", "e2"]
        assert sum(r["requests"] for r in run["replicas"].values()) == report["requests_per_policy"]
        assert all(r["guard_routed_requests"] == r["requests"] for r in run["replicas"].values()), policy
    assert report["prefill"]["cached_tokens"] > 0
    assert set(report["verdicts"]) == {"hit_ratio_2x_round_robin", "max_load_within_1_5x_mean",
                                       "ttft_p50_below_round_robin_and_least_loaded"}
    for plot in ("hit_ratio_ttft", "replica_load"):
        assert (tmp_path / f"{plot}.png").read_bytes().startswith(b"\x89PNG"), plot
