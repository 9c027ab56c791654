"""The telemetry-overhead benchmark still runs end to end (a few short rounds; the figures mean nothing)."""

from __future__ import annotations

import sys

import pytest
from support import ROOT
from support.processes import run_command


@pytest.mark.slow  # 17 s; a benchmark's plumbing: the telemetry itself is tested in tests/engine/test_server_telemetry.py
def test_telemetry_overhead_benchmark_runs() -> None:
    result = run_command(sys.executable, ROOT / "bench" / "telemetry_overhead.py", "--rounds", "4",
                         "--round-seconds", "0.3", "--amplify", "2", "--concurrency", "4", "--max-tokens", "16")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("machine: ") and lines[1].startswith("command: ")
    assert any(line.startswith("1 subscriber (") for line in lines)
    assert any(line.startswith("2 subscribers (") for line in lines)
    assert sum("event-loop CPU" in line for line in lines) == 2
