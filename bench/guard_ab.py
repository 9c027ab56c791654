"""The guard's CPU per request, two trees side by side: A (a baseline commit) and B (this tree).

Both guards run at the same time, pinned to the same core, in front of one fast upstream
(bench/fast_upstream.py, pinned with the load generator to the other core), each with one tenant and a
pool of one. For every workload of bench/guard_overhead.py (unary, stream, firehose) and every round, the
two are loaded at once, each by its own closed-loop generator, and each guard's CPU per request is read
from the scheduler (bench/proc_stats.py). Loading them together puts whatever slows the shared machine on
both alike, so the ratio B/A resolves a few percent where consecutive runs drift by tens; which of the two
is started first, and loaded first, alternates per round (B started second every round read ~1 % cheaper
in A/A runs: two worktrees of one commit, 0.992 over 20 rounds; 1.000 with the starts alternating). Each
round starts both guards afresh (``--same-guards`` keeps them): two runs with the same two processes each
disagreed by 2-3 % more than their rounds did, a bias of the process pair itself (its memory layout, its
hash seed), which only fresh pairs average out. Figures: medians over rounds, per workload, and the median
ratio.

    .venv/bin/python bench/guard_ab.py --baseline <commit>          # A = that commit, B = this tree
    .venv/bin/python bench/guard_ab.py --a /path/to/tree --rounds 8
    .venv/bin/python bench/guard_ab.py --baseline HEAD --quick      # one 1-s round: checks that it runs
    .venv/bin/python bench/guard_ab.py --a /path/to/tree --pool 3   # both guards with a pool of three
    .venv/bin/python bench/guard_ab.py --a <worktree of HEAD> --pool-a 1 --pool 3   # a pool of three against one
    .venv/bin/python bench/guard_ab.py --a-relay --rounds 8         # this guard against a bare aiohttp relay
    .venv/bin/python bench/guard_ab.py --baseline HEAD~1 --loads unary  # one workload only

The upstream runs this tree's bench/fast_upstream.py. A baseline whose guard cannot read this tree's telemetry
(a guard refuses fields it does not know, and the engine's snapshot gained some since: a1b9534 is one) needs
``--upstream-tree a``: the upstream then runs the baseline's own fast_upstream.py on the baseline's engine
protocol, which the newer guard reads too (fields added since have defaults).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from guard_overhead import API_KEY, check_relays, measure, workloads
from loadgen import generator
from run_info import command, describe, side_by_side_report, write_report
from stack import REPO, Service, baseline_tree, free_port, pinned, start, start_bare_relay, start_guard


def compare(tree_a: Path, args: argparse.Namespace, workdir: Path) -> dict:
    pin = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2
    proxy_cpus, load_cpus = ("0", "1") if pin else (None, None)
    kind = generator()
    loads = [load for load in workloads(args.stream_events, args.interval_ms, args.firehose_events)
             if load.name in args.loads]
    port = free_port()
    upstream_tree = tree_a if args.upstream_tree == "a" else REPO
    # The tree's own engine protocol first on the path: the installed package is this tree's.
    launch = (f"import runpy, sys; sys.path.insert(0, {str(upstream_tree)!r}); "
              f"runpy.run_path({str(upstream_tree / 'bench' / 'fast_upstream.py')!r}, run_name='__main__')")
    upstream = start("upstream", pinned([sys.executable, "-c", launch, "--port", str(port)], load_cpus),
                     f"http://127.0.0.1:{port}", workdir, tree=upstream_tree)
    # A pool of several: the one upstream under as many names, each with its telemetry and KV events, every
    # request ranked by the scheduling profile (as bench/guard_overhead.py's pool3).
    def config(replicas: int) -> dict:
        pool = ({"engine": {"name": "primary", "url": upstream.url}} if replicas == 1
                else {"engines": [{"name": f"r{i}", "url": upstream.url} for i in range(replicas)]})
        return {**pool, "secret": "bench-guard-ab",
                "tenants": [{"name": "bench", "api_keys": [API_KEY], "lane": "interactive", "max_queue": 100000}]}

    guards: dict[str, Service] = {}

    def start_both(order: tuple[str, str]) -> None:
        """Both guards afresh, started in ``order``: the one started second read ~1 % cheaper in A/A runs when
        A always came first (an A/A of two worktrees of one commit: 0.992, 20 rounds)."""
        for service in guards.values():
            service.stop()
        for name in order:
            guards[name] = (start_bare_relay(workdir, upstream.url, proxy_cpus) if name == "A" and args.a_relay
                            else start_guard(workdir, config(args.pool_a if name == "A" else args.pool), proxy_cpus,
                                             name=f"guard-{name.lower()}", tree=tree_a if name == "A" else REPO))
        check_relays({"direct": upstream.url, **{name: guards[name].url for name in ("A", "B")}}, loads)

    try:
        cpu: dict[str, dict[str, list[float]]] = {load.name: {"A": [], "B": []} for load in loads}
        # Requests per second too: a guard's fixed costs (telemetry, timers) spread over fewer requests when
        # its answers come slower, so a ratio of CPU per request is read beside a ratio of rates.
        rates: dict[str, dict[str, list[float]]] = {load.name: {"A": [], "B": []} for load in loads}
        for index in range(args.rounds):
            order = ("A", "B") if index % 2 == 0 else ("B", "A")
            if index == 0 or args.fresh:
                start_both(order)
            for load in loads:
                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    runs = {name: pool.submit(measure, kind, guards[name].url, load, args, workdir, guards[name],
                                              upstream, load_cpus) for name in order}
                for name in order:
                    figures = runs[name].result()
                    if figures["errors"]:
                        raise RuntimeError(f"guard {name} answered {figures['errors']} errors under {load.name}")
                    cpu[load.name][name].append(figures["proxy_cpu_us_per_request"])
                    rates[load.name][name].append(figures["requests_per_s"])
                a, b = cpu[load.name]["A"][-1], cpu[load.name]["B"][-1]
                rate = rates[load.name]["B"][-1] / rates[load.name]["A"][-1]
                print(f"  round {index + 1} {load.name:8} A {a:7,.0f} us/req  B {b:7,.0f} us/req  B/A {b / a:.3f}"
                      f"  (requests/s B/A {rate:.3f})", flush=True)
    finally:
        for service in (*guards.values(), upstream):
            service.stop()
    return {
        "benchmark": "guard_ab", "machine": describe(torch.device("cpu")), "command": command(),
        "a": "bench/bare_relay.py" if args.a_relay else str(tree_a), "b": str(REPO),
        "upstream_tree": args.upstream_tree, "load_generator": kind,
        "rounds": args.rounds, "duration_s": args.duration, "fresh_guards_per_round": args.fresh,
        "connections": args.connections, "pool": args.pool, "pool_a": args.pool_a,
        "layout": "both guards pinned to core 0; load and upstream to core 1" if pin else "not pinned",
        "cpu_us_per_request": cpu, "requests_per_s": rates,
        "summary": {name: {"a_us": statistics.median(by["A"]), "b_us": statistics.median(by["B"]),
                           "ratio_b_over_a": statistics.median(b / a for a, b in zip(by["A"], by["B"]))}
                    for name, by in cpu.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a git ref checked out as tree A (B is this tree)")
    parser.add_argument("--a", type=Path, help="tree A (instead of --baseline)")
    parser.add_argument("--a-relay", action="store_true", help="A is bench/bare_relay.py, the least an aiohttp "
                        "proxy does (instead of a guard): B/A is the guard against that floor, side by side")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--pool", type=int, default=1, help="replicas in each guard's pool (the one upstream under "
                        "as many names): 3 measures the ranking of a pool of three")
    parser.add_argument("--pool-a", type=int, help="A's pool, when it differs (default: --pool): with --a at this "
                        "tree's commit, --pool-a 1 --pool 3 measures a pool of three against a pool of one")
    parser.add_argument("--loads", nargs="+", choices=("unary", "stream", "firehose"),
                        default=["unary", "stream", "firehose"], help="the workloads measured (default: all)")
    parser.add_argument("--stream-events", type=int, default=32)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument("--firehose-events", type=int, default=256)
    parser.add_argument("--upstream-tree", choices=("a", "b"), default="b",
                        help="whose bench/fast_upstream.py (and engine protocol) the upstream runs (see above)")
    parser.add_argument("--same-guards", dest="fresh", action="store_false",
                        help="keep the two guard processes for every round (by default each round starts both "
                             "afresh: a process's memory layout and hash seed bias its CPU by 1-3 %%, which only "
                             "fresh processes average out)")
    parser.add_argument("--quick", action="store_true", help="one round of 1-s measurements: checks that it runs")
    parser.add_argument("--json", type=Path, help="write the raw report here")
    args = parser.parse_args()
    if (args.baseline is not None) + (args.a is not None) + args.a_relay != 1:
        parser.error("give exactly one of --baseline, --a and --a-relay")
    if args.quick:
        args.rounds, args.duration = 1, 1.0
    args.pool_a = args.pool_a or args.pool
    with tempfile.TemporaryDirectory(prefix="guard-ab-") as workdir, \
            baseline_tree(args.baseline, REPO if args.a_relay else args.a, Path(workdir)) as a:
        report = compare(a.resolve(), args, Path(workdir))
    print(f"machine: {report['machine']}\ncommand: {report['command']}")
    if args.quick:
        print("QUICK RUN: 1-second measurements, not a measurement")
    print(f"A = {report['a']}" + (f" ({args.baseline})" if args.baseline else "") + f"\nB = {report['b']}")
    print(f"load generator: {report['load_generator']}; {report['layout']}; {args.rounds} rounds of "
          f"{args.duration:g} s, {args.connections} connections, pools of {args.pool_a} (A) and "
          f"{args.pool} (B); "
          + ("both guards started afresh each round" if args.fresh else "the same two guards throughout"))
    print(f"{'workload':9} {'A us/req':>9} {'B us/req':>9} {'B/A':>6}")
    for name, row in report["summary"].items():
        print(f"{name:9} {row['a_us']:>9,.0f} {row['b_us']:>9,.0f} {row['ratio_b_over_a']:>6.3f}")
    if args.json is not None:
        write_report(args.json, side_by_side_report(report))
        print(f"json: {args.json}")


if __name__ == "__main__":
    main()
