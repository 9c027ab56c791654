"""Rolling restart under load (issue 42, "Drain"): engines and then guards restarted one at a time behind the
compose stack's haproxy (deploy/haproxy.cfg, addresses changed only), with two guards sharing a real Redis
and tiny engine replicas, all real processes (tests/support/rolling_restart.py). Clients stream and wait for
unary answers through haproxy the whole time: not one request fails, every answer comes back whole, and its
text is the uninterrupted greedy answer (a request an engine handed back while draining was resumed on
another replica with what it had sent). A guard told to stop is taken out by haproxy's health check
(/health 503 draining) while it still listens, and exits 0.

The quick case restarts one engine of two and one guard; the whole one (``slow``), every engine of three and
then both guards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.processes import Processes
from support.rolling_restart import GUARDS, rolling_restart, start_stack


def check(report: dict[str, Any], restarts: int) -> None:
    print(report)
    assert report["failed"] == 0, report["failures"]
    assert report["complete"] == report["sent"] > 0, report
    assert report["texts_equal"] == report["complete"], report
    assert len(report["steps"]) == restarts
    for step in report["steps"]:
        assert step["exit_code"] == 0, step
        if step["restarted"] in GUARDS:
            assert step["out_before_exit"], step


async def test_one_engine_and_one_guard_restarted_under_load_nothing_fails(tmp_path: Path,
                                                                           processes: Processes) -> None:
    stack = start_stack(processes, tmp_path, engines=2)
    report = await rolling_restart(stack, stack.engines[:1], list(GUARDS[:1]), streams=4, unary=2)
    check(report, 2)


@pytest.mark.slow
async def test_rolling_restart_of_every_engine_then_both_guards_nothing_fails(tmp_path: Path,
                                                                              processes: Processes) -> None:
    stack = start_stack(processes, tmp_path, engines=3)
    report = await rolling_restart(stack, stack.engines, list(GUARDS), streams=8, unary=4)
    check(report, 5)
