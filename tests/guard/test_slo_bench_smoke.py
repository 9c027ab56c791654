"""The SLO benchmark (bench/slo.py) still runs: its ``--quick`` mode as its own process, and its report's
shape. A few seconds of load on a shared machine say nothing about attainment, so no figure is judged:
what is checked is that the three configurations each offered both lanes the same load and were measured,
and that the SLO guard's decision log fed the prediction's error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from support import ROOT
from support.processes import run_command

LABELS = ["(a) kvguard with SLOs", "(b) kvguard without SLOs", "(c) FIFO straight to the engine"]


def test_slo_bench_quick(tmp_path: Path) -> None:
    result = tmp_path / "slo.json"
    done = run_command(sys.executable, ROOT / "bench" / "slo.py", "--quick", "--json", result, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "QUICK RUN" in done.stdout
    report = json.loads(result.read_text())
    assert report["benchmark"] == "slo" and report["machine"] and report["capacity_tokens_per_s"] > 0
    assert [phase["label"] for phase in report["phases"]] == LABELS
    sent = {lane: {phase["lanes"][lane]["sent"] for phase in report["phases"]} for lane in ("interactive", "batch")}
    assert all(len(counts) == 1 and counts.pop() > 0 for counts in sent.values()), sent  # the same arrivals
    for phase in report["phases"]:
        for lane in phase["lanes"].values():
            assert sum(lane["statuses"].values()) == lane["sent"] and 0 <= lane["met"] <= lane["sent"]
            assert isinstance(lane["engine_preemptions"], int)
        assert 0 <= phase["engine_kv_used_mean"] <= 1 and phase["engine_tokens_per_s"] > 0, phase
        assert len(phase["blocks"]) == report["load"]["rounds"], phase["blocks"]
    ratio, ceiling = report["goodput_over_without_slo"], report["ceiling_over_without_slo"]
    assert ratio is None or ceiling >= ratio, (ratio, ceiling)  # (None: (b) met nothing in these seconds)
    assert report["prediction"]["all"]["n"] > 0
