"""The Fill-and-Squeeze harness still runs: its ``--quick`` mode (the two-key colluding variant) as its own
process, and its report's shape.

No timing and no verdict is asserted: phases of a few seconds on a shared machine say nothing about the
guard. What is checked is that both runs, both phases, the engine and guard readings, the detection record
and the three plots come out, so the harness cannot rot between the runs that matter.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support.processes import run_command

TTFT_FIGURES = {"n", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms"}


@pytest.mark.slow  # 31 s; a benchmark's plumbing: detection is tested in tests/guard/test_detector*.py
def test_fill_squeeze_quick(tmp_path: Path) -> None:
    done = run_command(sys.executable, "-m", "bench.attacks.fill_squeeze", "--quick", "--keys", "2", "--out", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "QUICK RUN" in done.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["quick"] is True and report["benchmark"] == "fill_squeeze"
    assert set(report["runs"]) == {"unguarded", "guarded"}
    for name, run in report["runs"].items():
        assert run["target"] == ("engine" if name == "unguarded" else "guard")
        for phase in ("baseline", "attack"):
            victims = run["victims"][phase]
            assert victims["sent"] > 0 and sum(victims["statuses"].values()) == victims["sent"], (name, phase)
            assert set(victims["ttft"]) == TTFT_FIGURES
            assert isinstance(run["engine_preemptions"][phase], int)
        assert set(run["ttft_ratios"]) == {"mean", "p50", "p99"}
        assert set(run["longest_sampling_gap_s"]) == {"baseline", "attack"}
        assert sum(run["attacker"]["probe"].values()) > 0, name  # the attacker did attack
        columns, rows = run["timeline"]["columns"], run["timeline"]["rows"]
        assert rows and all(len(row) == len(columns) for row in rows)
        states = {row[columns.index("state")] for row in rows}
        if name == "unguarded":
            assert states == {None}  # no guard to scrape
        else:
            assert None not in states
        assert len(run["victim_requests"]) == sum(run["victims"][p]["sent"] for p in ("baseline", "attack"))
    assert set(report["control"]["victims"]) == {"baseline", "attack"}  # the same victims, no attacker
    assert set(report["runs"]["guarded"]["ttft_vs_control"]) == {"mean", "p50", "p99"}
    assert report["runs"]["unguarded"]["detection"] is None
    assert set(report["runs"]["guarded"]["detection"]) == {"suspect_after_fill_s", "confirmed_after_fill_s",
                                                           "confirmed_at_s", "victims_flagged"}
    assert report["attack_plan"]["keys"] == ["attacker-1", "attacker-2"]  # the colluding variant
    assert set(report["verdicts"]) == {"unguarded_mean_ttft_ratio", "unguarded_preemptions_climb",
                                       "guarded_p99_ttft_ratio", "guarded_preemptions_share", "confirmed_within_10_s",
                                       "victims_never_flagged"}
    for plot in ("victim_ttft", "free_blocks", "detector"):
        assert (tmp_path / f"{plot}.png").read_bytes().startswith(b"\x89PNG"), plot
