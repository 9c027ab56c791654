"""The fleet fault matrix (issue 29): two guards sharing state through a real Redis, two real engines (one behind
a relay that can black-hole it), one busy tenant per guard, one fault per cell (tests/support/fault_matrix.py).
Every cell: nothing lost (every request a whole answer or an explicit error), every block and reservation
back; in the Redis cells, no engine preemption; after an outage that finds one guard holding every engine's
budget, the guards' reservations never above an engine's pool. (Elsewhere ``over_budget`` is measured, not
asserted: what the other guard was granted in the last renewal period (0.2 s) before an outage is unseen,
and a few runs reached 4 to 12 blocks over; see docs/benchmarks.md.)

Three Redis cells run in make test (the lopsided outage, slow, flapping: about 40 s with the fleet's start);
the plain outage, Redis asleep back to back, and the guard, engine and black-hole cells are ``slow`` (the
lopsided outage covers their conservative mode; they add a guard process, an engine restart and the upstream
deadlines). Issue 42 added Redis connected but unresponsive for the whole load (``DEBUG SLEEP 3`` back to
back: no preemption), and an engine killed and one stopped past the guards' silence deadline, whose streams
move to the other engine: none of them ends with an error event.
``bench/faults.py`` prints the whole table.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fault_matrix import CELLS, Cell, Fleet, redis_link_cut, run_cell
from support.netns import Netns

REDIS_CELLS = {"redis killed", "redis killed after one guard borrowed all", "redis slow (DEBUG SLEEP)",
               "redis slow, back to back (DEBUG SLEEP 3)", "redis flapping"}
# The lopsided outage asks more of conservative mode than the plain one; back-to-back sleeps hold Redis 3 s.
FAST_CELLS = REDIS_CELLS - {"redis killed", "redis slow, back to back (DEBUG SLEEP 3)"}
# Issue 42: what ran on an engine that died or went silent moved to the other, whole.
ENGINE_CELLS = {"engine killed", "engine stopped (SIGSTOP, silent)"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root: Path = tmp_path_factory.mktemp("fleet")
    with Fleet(root, seconds=2.5) as started:
        yield started


@pytest.mark.parametrize("cell", [name if name in FAST_CELLS else pytest.param(name, marks=pytest.mark.slow)
                                  for name in CELLS])
def test_cell_loses_nothing_and_never_overcommits(fleet: Fleet, cell: str) -> None:
    row = run_cell(fleet, cell, CELLS[cell])
    assert row.ok > 0, row
    assert row.lost == 0, row
    assert row.blocks_back and row.reservations_back, row
    if cell in REDIS_CELLS:
        assert row.preemptions == 0, row
    if cell == "redis killed after one guard borrowed all":  # before issue 29's fix: 6 to 8 blocks over
        assert row.over_budget <= 0, row
    if cell in ENGINE_CELLS:  # refusals at admission (a full pool) may be; a stream broken off may not
        assert not any("stream error event" in kind for kind in row.errors), row


@pytest.mark.slow
def test_a_cut_link_to_redis_loses_nothing_and_never_preempts(tmp_path: Path) -> None:
    """Issue 42: Redis in a network namespace of the test's own, its link cut (silence, no reset) while both
    guards flood: each falls back to its conservative share, the engines never preempt, nothing is lost."""
    with Netns(1) as ns, Fleet(tmp_path, seconds=4.0, redis_netns=ns) as fleet:
        row = run_cell(fleet, "redis link cut", Cell(redis_link_cut))
    assert row.ok > 0 and row.lost == 0 and row.preemptions == 0, row
    assert row.blocks_back and row.reservations_back, row
