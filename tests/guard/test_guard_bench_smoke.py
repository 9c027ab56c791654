"""The guard benchmarks still run: each one's ``--quick`` mode as its own process, and its report's shape.

No timing is asserted (on a shared machine a figure says nothing about the code); what is checked is that
every configuration was measured and reported, so the scripts cannot rot between the runs that matter.
nginx and wrk are Debian packages that a fresh machine may lack: without nginx the overhead benchmark
compares the guard with direct only, without wrk it uses its Python load generator, and the test checks
that the report says which.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from support.processes import run_bench


@pytest.mark.slow  # 20 s of two tenants' load; the guard's fairness is tested in tests/guard/test_guard_load.py
def test_noisy_neighbour_quick(tmp_path: Path) -> None:
    out, report = run_bench("noisy_neighbour.py", tmp_path)
    phases = report["phases"]
    assert [(p["label"][:3], p["target"], p["b_share"]) for p in phases] == [
        ("(a)", "guard", None), ("(b)", "guard", 0.3), ("(c)", "engine", None)]
    assert phases[0]["b"]["sent"] == 0 and phases[1]["b"]["sent"] > 0 and phases[2]["b"]["sent"] > 0
    for phase in phases:
        assert phase["a"]["sent"] > 0
        for tenant in ("a", "b"):  # every request sent ends in exactly one reported status
            assert sum(phase[tenant]["statuses"].values()) == phase[tenant]["sent"]
        assert set(phase["a"]["ttft"]) == {"n", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms"}
        assert set(phase["ttft_over_a"]) == {"mean", "p50", "p99"}
    assert [v["label"][:3] for v in report["verdicts"]] == ["(b)", "(c)"]
    assert "(c) A + B, straight to the engine" in out and "p99/(a)" in out


@pytest.mark.slow  # half a minute of four proxies under load; a benchmark's plumbing, not a behaviour
def test_guard_overhead_quick(tmp_path: Path) -> None:
    out, report = run_bench("guard_overhead.py", tmp_path)
    has_nginx = shutil.which("nginx") is not None
    assert report["load_generator"] == ("wrk" if shutil.which("wrk") else "python")
    targets = {"direct", "guard", "pool3", "aiohttp"} | ({"nginx"} if has_nginx else set())
    assert set(report["summary"]) == {"unary", "stream", "firehose"}
    for workload, by_target in report["summary"].items():
        assert set(by_target) == targets, workload
        for target, row in by_target.items():
            assert row["requests_per_s"] > 0, (workload, target)
            assert (row["added_p99_ms"] is None) == (target == "direct")
        if workload != "unary":
            assert all(row["events_per_s"] > 0 for row in by_target.values())
    assert 0 < report["verdicts"]["guard_cpu_share_spent_in_a_bare_relay"]
    assert report["verdicts"]["pool3_cpu_per_request_ratio"] > 0 and "pool of 3 vs pool of 1" in out
    share = report["verdicts"]["guard_rps_share_of_nginx"]
    if has_nginx:
        assert share is not None and report["nginx"].startswith("nginx")
    else:
        assert share is None and "not installed" in report["nginx"]
        assert "n/a (nginx not installed)" in out



@pytest.mark.slow  # SmolLM2 under four guards; tests/guard/test_no_max_tokens.py checks the behaviour
def test_no_max_tokens_quick(tmp_path: Path) -> None:
    """Every guard ran the same requests, every one was answered, and the report carries the issue's figures."""
    out, report = run_bench("no_max_tokens.py", tmp_path)
    assert report["benchmark"] == "no_max_tokens" and report["quick"] is True and report["machine"]
    workload = report["workload"]
    assert workload["clients"] >= 1 and workload["offered_over_capacity"] > 1
    assert len(workload["exact_max_tokens"]) == workload["prompts"] and all(workload["exact_max_tokens"])
    assert list(report["configs"]) == ["fallback", "queue"]
    for config in report["configs"].values():
        assert list(config["arms"]) == ["no_max", "exact"]
        for arm in config["arms"].values():
            assert arm["requests"] == workload["prompts"] == sum(arm["statuses"].values())
            assert arm["served_by_primary"] + arm["fallback_routes"] == arm["requests"], arm["statuses"]
            assert set(arm["ttft"]) == {"n", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms"}
            assert set(arm["growths"]) == {"granted", "denied"}
        assert set(config["verdicts"]) >= {"p99_ttft_no_max_over_exact", "no_max_preemption_share",
                                           "no_max_fallback_routes", "exact_fallback_routes"}
    assert report["configs"]["queue"]["verdicts"]["no_max_fallback_routes"] == 0, "no fallback to go to"
    assert "p99 TTFT no_max / exact" in out


@pytest.mark.slow  # 17 s of two guards; every hot-path change runs bench/guard_ab.py itself, so it cannot rot unseen
@pytest.mark.parametrize("a", [("--baseline", "HEAD"), ("--a-relay",)], ids=["head", "bare-relay"])
def test_guard_ab_quick(tmp_path: Path, a: tuple[str, ...]) -> None:
    """The guard's A/B benchmark (the check that the guard's CPU per request never grows unnoticed): this
    tree against its own HEAD, checked out beside it, or against the bare aiohttp relay, each workload
    measured on both."""
    _, report = run_bench("guard_ab.py", tmp_path, *a)
    assert (report["a"] == "bench/bare_relay.py") == (a == ("--a-relay",))
    assert [row["workload"] for row in report["results"]] == ["unary", "stream", "firehose"]
    for row in report["results"]:
        assert row["a_us"] > 0 and row["b_us"] > 0 and row["ratio_b_over_a"] > 0, row
    assert report["rounds"] == 1 and report["load_generator"] == ("wrk" if shutil.which("wrk") else "python")


@pytest.mark.slow  # half a minute of a guard under valgrind; a benchmark's plumbing, not a behaviour
def test_guard_instructions_smoke(tmp_path: Path) -> None:
    """Every workload counted on this tree, net of the idle rate, and printed."""
    _, report = run_bench("guard_instructions.py", tmp_path, smoke=True, timeout=300)
    assert [row["workload"] for row in report["results"]] == ["unary", "stream", "firehose"]
    for load, by in report["counts"].items():
        figures = by["B"]
        assert set(by) == {"B"} and figures["requests"] == report["requests"], load
        # Net of the idle rate, and more than a request's parsing alone could take (a bare count of nothing).
        assert 0 < figures["instructions_per_request"] < figures["instructions"] / figures["requests"], load
        assert figures["idle_instructions_per_s"] > 0, load
    unary, stream = (report["counts"][load]["B"]["instructions_per_request"] for load in ("unary", "stream"))
    assert stream > unary  # a stream of 32 events costs the guard more than one unary answer
