"""The SLO benchmark (bench/slo.py) still runs: its ``--quick`` mode (S2 at L = 2, one round of 2-second
blocks, here (a) and B1 only) as its own process, and its reports' shape. A few seconds of load on a shared
machine say nothing about attainment, so no figure is judged: what is checked is that both configurations
offered every lane the same load and were measured, that the SLO guard's decision log fed the prediction's
error, and that the goals of cells that were not run are reported as not judged, never as met. Its
interactive bursts (``--interactive-on-off``) are checked on their own, without a run."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path

import pytest
from support import ROOT
from support.processes import run_command


@pytest.mark.slow  # ~20 s (an engine, its calibration, two guards, each block drained): make test-slow
def test_slo_bench_quick(tmp_path: Path) -> None:
    done = run_command(sys.executable, ROOT / "bench" / "slo.py", "--quick", "--configs", "a,b1",
                       "--out-dir", tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "QUICK RUN" in done.stdout
    report = json.loads((tmp_path / "S2_L2.json").read_text())
    assert report["benchmark"] == "slo" and report["machine"] and report["capacity_tokens_per_s"] > 0
    assert list(report["configs"]) == ["a", "b1"] and report["quick"] is True
    blocks = {config: entry["blocks"] for config, entry in report["configs"].items()}
    assert all(len(b) == 1 for b in blocks.values()), blocks
    sent = {lane: {b[0]["lanes"][lane]["sent"] for b in blocks.values()} for lane in ("interactive", "batch")}
    assert all(len(counts) == 1 and counts.pop() > 0 for counts in sent.values()), sent  # the same arrivals
    for (block,) in blocks.values():
        for lane in block["lanes"].values():
            assert sum(lane["statuses"].values()) == lane["sent"]
            assert 0 <= lane["met"] <= lane["served"] <= lane["sent"] and lane["late"] == lane["served"] - lane["met"]
        assert block["engine_tokens_per_s"] > 0 and isinstance(block["critical_preemptions"], int)
    assert report["configs"]["a"]["prediction"]["predicted_ttft_ms"]["all"]["n"] > 0
    assert report["configs"]["b1"]["prediction"] == {}  # no objective, no prediction
    assert len(report["oracle_goodput_per_s"]) == 1
    goals = {(g["cell"], g["goal"]): g for g in json.loads((tmp_path / "goals.json").read_text())["goals"]}
    assert goals[("S1_L2", "gate: B1 interactive attainment at L = 2")]["met"] is None  # not run: not judged
    assert goals[("S2_L2", "(a) late share of served sheddable (batch)")]["per_round"] or \
        blocks["a"][0]["lanes"]["batch"]["served"] == 0


def test_bursts_arrive_only_within_them_at_the_same_mean_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--interactive-on-off``: bench/tenant_load.py's arrivals fall within the bursts only, at the same mean
    rate (50/s over 60 s, in bursts of 1 s every 4 s: 3,000 expected, 55 its standard deviation); without
    bursts a seed gives the same times as plain Poisson arrivals."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from tenant_load import Result, arrivals

    async def fire(result: Result) -> None:
        pass

    async def times(on_off: tuple[float, float] | None) -> list[float]:
        start, got = time.monotonic() - 100.0, []  # every arrival already due: nothing waits
        tasks = await arrivals(50.0, 7, start, 60.0, fire, got, on_off)
        await asyncio.gather(*tasks)
        return [r.arrival - start for r in got]

    bursts = asyncio.run(times((1.0, 3.0)))
    assert 2800 < len(bursts) < 3200 and all(t % 4.0 < 1.0 for t in bursts) and max(bursts) < 60.0
    rng, at, plain = random.Random(7), 0.0, []
    while (at := at + rng.expovariate(50.0)) < 60.0:
        plain.append(at)
    assert asyncio.run(times(None)) == pytest.approx(plain, abs=1e-9)
