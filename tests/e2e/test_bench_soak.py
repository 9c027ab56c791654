"""The soak (bench/soak.py) still runs end to end: 6 seconds with both engine restarts and the attack
bursts. At this length its latency and memory figures mean nothing; what must hold at any length is that
nothing is lost."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support import ROOT
from support.processes import run_command


@pytest.mark.slow  # half a minute; the nothing-lost invariants run in make test through tests/support/nothing_lost.py
def test_soak_runs_and_loses_nothing(tmp_path: Path) -> None:
    report = tmp_path / "soak.json"
    result = run_command(sys.executable, ROOT / "bench" / "soak.py", "--minutes", "0.1", "--report", report)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("machine: ") and lines[1].startswith("command: ")
    figures = json.loads(report.read_text())
    assert figures["sent"] == figures["answered"] == figures["whole"] == figures["guard_outcomes"] > 0
    assert figures["leaked_blocks"] == figures["guard_reserved_blocks"] == figures["guard_queued"] == 0
    assert [restart["signal"] for restart in figures["restarts"]] == ["SIGKILL", "SIGTERM"]
    assert {key.split()[0] for key in figures["by_tenant"]} == {"acme", "globex", "bulk", "mallory"}
    assert figures["guard_rss_mib"]["end"] > 0
