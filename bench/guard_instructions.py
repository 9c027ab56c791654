"""The guard's work per request in CPU instructions, two trees one after the other: A (a baseline) and B (this tree).

``bench/guard_ab.py`` measures CPU time side by side, whose noise on this shared VM is a few percent per
round; it cannot tell a change of 0.5 % from none without many rounds. An instruction count can: each guard
runs under valgrind's callgrind with counting switched off until it has served a warm-up, then on for exactly
``--requests`` requests (``callgrind_control -i on``), then for ``--idle`` seconds with none; the guard's
instructions per request are the first window's less the idle rate times its length (telemetry, timers:
work per second, not per request). Two runs of one tree agree within about 0.3 %. What an instruction count
does not see: cache misses, system calls and the kernel's side of the sockets (two reads and two writes a
request either way), so a change that trades instructions for memory traffic needs guard_ab too, and the
ratio of two counts is not the ratio of two CPU times (a 1.09x count gap read 1.13-1.15x in guard_ab).
What runs by the clock runs differently at valgrind's pace: each replica's latency model learns from one
request per 10 ms at most (guard/pool/latency.py, ``SAMPLE_INTERVAL_S``), which under valgrind (~40 requests
a second) is every request and at guard_ab's rate about one in twenty, so a count includes all of that learning.

Each workload is a sequence of requests from ``CLIENT_THREADS`` client threads, the requests of
bench/guard_ab.py: unary; a stream of ``--stream-events`` events ``--interval-ms`` apart; a firehose of
``--firehose-events`` unpaced events. How a stream's bytes arrive matters: a guard reads a paced stream an
event a chunk, but the slower it reads, the more events each read finds, and the guard's path differs
(under valgrind it runs ~50x slower). Paced at 20 ms, each of the streams in flight sends its event long
after the guard read the last one, as without valgrind; a firehose is read in chunks of several events
either way, larger ones here. Per tree and workload a fresh upstream (bench/fast_upstream.py of
``--upstream-tree``) and a fresh guard with ``PYTHONHASHSEED=0``, pool of one.

    .venv/bin/python bench/guard_instructions.py                          # this tree alone
    .venv/bin/python bench/guard_instructions.py --baseline 94ca4f6 --upstream-tree a
    .venv/bin/python bench/guard_instructions.py --a /path/to/tree --loads unary
    .venv/bin/python bench/guard_instructions.py --smoke                  # a few requests: checks that it runs

Needs valgrind (``make system-tools`` installs it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import yaml
from guard_overhead import API_KEY, PROMPT
from run_info import command, describe, side_by_side_report, write_report
from stack import REPO, Service, baseline_tree, free_port, guard_has_telemetry, start

CLIENT_THREADS = 8  # at most 8 streams of events 20 ms apart: the guard reads each event on its own
WARM_UP = 200  # requests served before counting: imports, caches, specialised bytecode, pools of connections
GUARD_START_S = 300.0  # a guard under valgrind starts in about 10 s here; a slow machine gets time


def bodies(stream_events: int, interval_ms: float, firehose_events: int) -> dict[str, bytes]:
    base = {"model": "tiny", "prompt": PROMPT, "temperature": 0.0}
    loads = {"unary": {**base, "max_tokens": 16},
             "stream": {**base, "max_tokens": stream_events, "stream": True, "interval_ms": interval_ms},
             "firehose": {**base, "max_tokens": firehose_events, "stream": True, "interval_ms": 0}}
    return {name: json.dumps(body).encode() for name, body in loads.items()}


def send(url: str, body: bytes, count: int) -> float:
    """``count`` requests from ``CLIENT_THREADS`` threads; the seconds it took. An answer that is not 200 stops
    the run: a count over refusals would measure the wrong path."""
    def one(_: int) -> None:
        request = urllib.request.Request(url + "/v1/completions", data=body, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()

    started = time.monotonic()
    with ThreadPoolExecutor(CLIENT_THREADS) as pool:
        list(pool.map(one, range(count)))
    return time.monotonic() - started


def instructions(path: Path) -> int:
    """The instructions a callgrind dump counted (its ``totals:`` line)."""
    for line in path.read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    raise RuntimeError(f"{path}: no totals in the callgrind dump")


def control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def measure(tree: Path, upstream_tree: Path, body: bytes, args: argparse.Namespace, workdir: Path, name: str) -> dict:
    """One guard of ``tree`` under callgrind, one workload: instructions per request."""
    port = free_port()
    launch = (f"import runpy, sys; sys.path.insert(0, {str(upstream_tree)!r}); "
              f"runpy.run_path({str(upstream_tree / 'bench' / 'fast_upstream.py')!r}, run_name='__main__')")
    upstream = start(f"{name}-upstream", [sys.executable, "-c", launch, "--port", str(port)],
                     f"http://127.0.0.1:{port}", workdir, tree=upstream_tree)
    guard: Service | None = None
    try:
        guard_port = free_port()
        config = workdir / f"{name}.yaml"
        config.write_text(yaml.safe_dump({
            "engine": {"name": "primary", "url": upstream.url}, "secret": "bench-guard-instructions",
            "tenants": [{"name": "bench", "api_keys": [API_KEY], "lane": "interactive", "max_queue": 100000}],
            "listen": {"host": "127.0.0.1", "port": guard_port}}))
        dumps = workdir / f"{name}.callgrind"
        guard = start(name, ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={dumps}",
                             sys.executable, "-m", "guard", "--config", str(config), "--log-level", "WARNING"],
                      f"http://127.0.0.1:{guard_port}", workdir, ready=guard_has_telemetry,
                      timeout=GUARD_START_S, tree=tree)
        pid = guard.process.pid
        send(guard.url, body, args.warm_up)
        control(pid, "-i", "on")
        busy = send(guard.url, body, args.requests)
        control(pid, "-d")  # dump 1: the requests (a dump zeroes the counters)
        time.sleep(args.idle)
        control(pid, "-d")  # dump 2: idle
        control(pid, "-i", "off")
        counted, idle = (instructions(Path(f"{dumps}.{i}")) for i in (1, 2))
        if args.keep is not None:  # for callgrind_annotate: where the instructions went, by C function
            args.keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(f"{dumps}.1", args.keep / f"{name}.callgrind")
        per_second = idle / args.idle
        return {"requests": args.requests, "seconds": busy, "instructions": counted,
                "idle_instructions_per_s": per_second,
                "instructions_per_request": (counted - per_second * busy) / args.requests}
    finally:
        if guard is not None:
            guard.stop(timeout=60.0)
        upstream.stop()


def run(args: argparse.Namespace, tree_a: Path | None, workdir: Path) -> dict:
    trees = {"B": REPO} if tree_a is None else {"A": tree_a, "B": REPO}
    upstream_tree = tree_a if args.upstream_tree == "a" and tree_a is not None else REPO
    loads = bodies(args.stream_events, args.interval_ms, args.firehose_events)
    results: dict[str, dict[str, dict]] = {}
    for load in args.loads:
        for label, tree in trees.items():
            figures = measure(tree, upstream_tree, loads[load], args, workdir, f"{label}-{load}")
            results.setdefault(load, {})[label] = figures
            print(f"  {load:8} {label}: {figures['instructions_per_request']:>12,.0f} instructions a request "
                  f"({figures['seconds']:.1f} s for {args.requests})", flush=True)
    summary = {}
    for load, by in results.items():
        row = {f"{label.lower()}_per_request": figures["instructions_per_request"] for label, figures in by.items()}
        if "A" in by:
            row["ratio_b_over_a"] = by["B"]["instructions_per_request"] / by["A"]["instructions_per_request"]
        summary[load] = row
    return {"benchmark": "guard_instructions", "machine": describe(torch.device("cpu")), "command": command(),
            "a": str(tree_a) if tree_a is not None else None, "b": str(REPO), "upstream_tree": str(upstream_tree),
            "requests": args.requests, "warm_up": args.warm_up, "idle_s": args.idle, "counts": results,
            "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a git ref checked out as tree A (B is this tree)")
    parser.add_argument("--a", type=Path, help="tree A (instead of --baseline)")
    parser.add_argument("--loads", nargs="+", choices=("unary", "stream", "firehose"),
                        default=["unary", "stream", "firehose"])
    parser.add_argument("--requests", type=int, default=400, help="requests counted per guard and workload")
    parser.add_argument("--warm-up", type=int, default=WARM_UP)
    parser.add_argument("--idle", type=float, default=4.0, help="seconds counted without requests")
    parser.add_argument("--stream-events", type=int, default=32)
    parser.add_argument("--interval-ms", type=float, default=20.0, help="between a stream's events")
    parser.add_argument("--firehose-events", type=int, default=256)
    parser.add_argument("--upstream-tree", choices=("a", "b"), default="b",
                        help="whose bench/fast_upstream.py (and engine protocol) the upstream runs: a baseline whose "
                             "guard refuses this tree's telemetry needs its own (as bench/guard_ab.py)")
    parser.add_argument("--smoke", action="store_true", help="a few requests of each workload: checks that it runs")
    parser.add_argument("--json", type=Path, help="write the raw report here")
    parser.add_argument("--keep", type=Path, help="keep each guard's counted dump here (callgrind_annotate reads it)")
    args = parser.parse_args()
    if args.baseline is not None and args.a is not None:
        parser.error("give at most one of --baseline and --a")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        parser.error("valgrind is not installed (make system-tools installs it)")
    if args.smoke:
        args.requests, args.warm_up, args.idle, args.interval_ms = 16, 8, 1.0, 1.0
    os.environ["PYTHONHASHSEED"] = "0"  # every process started: one hash seed, the same dict layouts each run
    with tempfile.TemporaryDirectory(prefix="guard-instructions-") as workdir, \
            baseline_tree(args.baseline, args.a, Path(workdir)) as a:
        report = run(args, a.resolve() if a is not None else None, Path(workdir))
    print(f"machine: {report['machine']}\ncommand: {report['command']}")
    if args.smoke:
        print("SMOKE RUN: a few requests, not a measurement")
    print(f"{'workload':9} {'A':>12} {'B':>12} {'B/A':>6}   (instructions a request)")
    for load, row in report["summary"].items():
        a = f"{row['a_per_request']:>12,.0f}" if "a_per_request" in row else f"{'-':>12}"
        ratio = f"{row['ratio_b_over_a']:>6.3f}" if "ratio_b_over_a" in row else f"{'-':>6}"
        print(f"{load:9} {a} {row['b_per_request']:>12,.0f} {ratio}")
    if args.json is not None:
        write_report(args.json, side_by_side_report(report))
        print(f"json: {args.json}")


if __name__ == "__main__":
    main()
