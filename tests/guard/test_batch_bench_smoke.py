"""The batch benchmark (bench/batch.py) still runs: its ``--quick`` mode as its own process, and its report's
shape. Seconds of load on a shared machine say nothing about the figures, so none is judged: what is checked
is that both phases got the same arrivals, that the batch's lines ran through the guard beside them, and that
the batch was cancelled at the end of its phase."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support import ROOT
from support.processes import run_command


# Slow (18 s of the suite's 15-minute budget): the report's shape only; the Batch API's behaviour is
# test_batch_api.py's, in seconds. `make test-slow` runs it.
@pytest.mark.slow
def test_batch_bench_quick(tmp_path: Path) -> None:
    result = tmp_path / "batch.json"
    done = run_command(sys.executable, ROOT / "bench" / "batch.py", "--quick", "--json", result, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(result.read_text())
    assert report["benchmark"] == "batch" and report["machine"]
    (one,) = report["rounds"]
    alone, beside = one["alone"], one["beside"]
    assert sum(alone["statuses"].values()) == sum(beside["statuses"].values()) > 0, "the same arrivals"
    assert alone["batch_request_counts"] is None
    counts = beside["batch_request_counts"]
    assert counts["total"] == 300 and 0 < counts["completed"] <= 300 and counts["failed"] == 0
    assert all(min(levels.values()) > 0 for levels in one["capacity_before_after"])
    assert beside["batch_tokens_per_s"] > 0 and alone["batch_tokens_per_s"] == 0, "the engine's count per tenant"
    assert alone["web_tokens_per_s"] > 0 and set(beside["why"]["cpu"]) == {"engine", "guard", "load generator"}
    assert set(one["left_measured_tokens_per_s"]) == {"32", "64"}
    assert all(tokens > 0 for tokens in one["left_measured_tokens_per_s"].values()), "the batch-shaped tenant's own"
    assert set(report["summary"]) == {"ttft_p50_beside_over_alone", "batch_share_of_left",
                                      "batch_share_of_left_measured", "per_round"}
