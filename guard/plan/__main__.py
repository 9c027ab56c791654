"""``python -m guard.plan --workload plan.yaml [--json] [--from-engine URL]``: print a capacity plan.

Exit status 0 with a plan (whatever its verdict), 2 when the input cannot give one (a missing or invalid
workload file, a model that cannot be read, an engine that cannot be reached), the message on stderr naming
the file, key or URL at fault.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from guard.plan.planner import make_plan
from guard.plan.report import to_json, to_text
from guard.plan.workload import PlanError, load_workload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m guard.plan", description="kvguard capacity planner: KV "
                                     "memory at peak streams, GPUs needed, and Erlang-C queueing.")
    parser.add_argument("--workload", required=True, type=Path, help="workload YAML (see plan.example.yaml)")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    parser.add_argument("--from-engine", metavar="URL", help="take the KV pool from the engine at URL "
                        "(its blocks x block size x the model's bytes per token) instead of the workload's gpu")
    args = parser.parse_args(argv)
    try:
        workload = load_workload(args.workload)
        plan = make_plan(workload, args.workload.resolve().parent, args.from_engine)
    except PlanError as exc:
        print(f"plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(to_json(plan), indent=2) if args.json else to_text(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
