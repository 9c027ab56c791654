"""Rolling restart under load (issue 42, "Drain") in figures: the compose stack's shape as processes (Redis,
three tiny engine replicas with ``--drain-timeout 2``, two guards sharing Redis with ``--drain-delay 5``,
haproxy on deploy/haproxy.cfg with only its addresses changed), closed-loop clients streaming and waiting
for unary answers through haproxy, every engine restarted in turn (SIGTERM, exit, start, back in every
guard's pool) and then each guard (SIGTERM, out of haproxy on its health check, exit, start, back in).

Row: requests sent, complete, failed (with what the first failures got), stream and unary texts equal to
the uninterrupted greedy answer, the guards' moves by reason during the engine restarts, and per restart its
exit code and seconds to exit and back (for a guard also the seconds until haproxy took it out, and whether
it still listened then). The scenario is tests/support/rolling_restart.py's, which the test runs too.

    .venv/bin/python bench/rolling_restart.py [--stream-tokens 160] [--report bench/results/rolling_restart.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the tests' processes, haproxy and scenario

from support.processes import Processes
from support.rolling_restart import GUARDS, rolling_restart, start_stack

from bench.run_info import command, describe, write_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8, help="streaming clients (closed loop)")
    parser.add_argument("--unary", type=int, default=4, help="unary clients (closed loop)")
    parser.add_argument("--stream-tokens", type=int, default=160,
                        help="tokens per stream: more than an engine's 2 s drain lets finish, so some are "
                        "handed back and resumed elsewhere")
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    machine = describe(torch.device("cpu"))
    print(f"machine: {machine}\ncommand: {command()}", flush=True)
    with tempfile.TemporaryDirectory() as root, Processes(Path(root)) as processes:
        stack = start_stack(processes, Path(root), engines=args.engines)
        row = asyncio.run(rolling_restart(stack, stack.engines, list(GUARDS), args.streams, args.unary,
                                          stream_tokens=args.stream_tokens))
    row = {"engines": args.engines, "guards": len(GUARDS), "streams": args.streams, "unary": args.unary,
           "stream_tokens": args.stream_tokens, **row}
    print(json.dumps(row, indent=1), flush=True)
    if args.report is not None:
        write_report(args.report, {"machine": machine, "command": command(), "rows": [row]})


if __name__ == "__main__":
    main()
