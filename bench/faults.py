"""The fleet fault matrix as a table (issue 29): two guards sharing a real Redis in front of real engines, one
busy tenant per guard, one fault per row; the cells are tests/support/fault_matrix.py's, which
tests/e2e/test_fault_matrix.py asserts on.

    .venv/bin/python bench/faults.py [--seconds 4] [--report bench/results/faults.json]

Columns: engine preemptions during the row; requests ok, refused with an explicit error, lost (hung, reset or
truncated), cut (in flight at a guard the row SIGKILLed); the worst excess of the guards' reservations over
an engine's pool (<= 0: never over-committed); whether every block and every reservation came back. The last
rows are issue 29's scenario (both guards in front of one engine, 24 streams each, Redis killed) and issue
42's (the same with Redis connected but asleep, ``DEBUG SLEEP 3`` back to back).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the cells live with the tests' process helpers

from support.fault_matrix import CELLS, Cell, Fleet, Row, redis_killed, redis_slow_back_to_back, run_cell

from bench.run_info import command, describe, write_report

COLUMNS = ("preemptions", "ok", "refused", "lost", "cut", "over_budget", "blocks_back", "reservations_back")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="load per row")
    parser.add_argument("--report", type=Path, default=None, help="also write the rows as JSON")
    args = parser.parse_args()
    print(f"machine: {describe(torch.device('cpu'))}")
    print(f"command: {command()}")
    rows = []
    print(f"{'cell':<48}" + "".join(f"{c:>18}" for c in COLUMNS))
    with tempfile.TemporaryDirectory() as root, Fleet(Path(root), seconds=args.seconds) as fleet:
        for name, cell in CELLS.items():
            rows.append(_row(fleet, name, lambda c=cell, n=name: run_cell(fleet, n, c)))
        # The relay swallows from here on: the row uses e0 alone.
        rows.append(_row(fleet, "issue: 1 engine, 24 streams/guard, redis killed",
                         lambda: run_cell(fleet, "issue", Cell(redis_killed), streams=24, one_engine=True)))
        rows.append(_row(fleet, "issue 42: the same, redis asleep back to back",
                         lambda: run_cell(fleet, "issue 42", Cell(redis_slow_back_to_back), streams=24,
                                          one_engine=True)))
    if args.report is not None:
        write_report(args.report, {"machine": describe(torch.device("cpu")), "command": command(), "rows": rows})


def _row(fleet: Fleet, name: str, run: Callable[[], Row]) -> dict:
    started = time.monotonic()
    row = run().as_dict()
    row["seconds"] = round(time.monotonic() - started, 1)
    print(f"{name:<48}" + "".join(f"{row[c]!s:>18}" for c in COLUMNS), flush=True)
    if row["errors"]:
        print(f"{'':<48}  {row['errors']}", flush=True)
    return row


if __name__ == "__main__":
    main()
