"""Guard scale-out: what shared state (Redis) costs one guard, and what a second worker adds, in one run.

Four targets in front of one upstream, unary completions (bench/guard_overhead.py's workload, measurement
and summary), closed-loop with ``--connections`` (64) in flight for ``--duration`` seconds, ``--rounds``
times in rotating order; medians are reported, added latency against the direct run of the same round:

- ``direct``: straight to the upstream;
- ``alone``: one guard process, no ``shared_state``: everything in the process;
- ``redis1``: one guard process with ``shared_state``: every admission is a decision in Redis and every
  release an update, carried in batches (a round trip takes everything its guard queued meanwhile);
- ``redis2``: ``python -m guard --workers 2`` with ``shared_state``: two processes on one port.

The upstream is bench/fast_upstream.py behind nginx, which answers the completions itself, from memory
(bench/nginx_proxy.py ``answers``; without nginx, fast_upstream.py answers them): the guard's side of the
machine is measured, not the upstream's Python. Debian: ``apt-get install wrk nginx-light redis-server``
(without wrk, bench/http_load.py generates the load, at a much higher cost to the load side's core).

Targets: shared state costs < 15% of one guard's requests/s, and ``redis2`` serves >= 1.6x ``redis1``. A
guard that is CPU-bound serves 1/(CPU per request), so the cost is read from ``alone``'s and ``redis1``'s
CPU per request measured side by side (both loaded at the same moment, once per round: the machine's noise
slows both alike); the medians of the table give it too. The 2-worker ratio is the median of the rounds'
``redis2``/``redis1``, with what the CPU per request says two workers would serve with a core each. The
Redis round trips are read from the guards' own ``guard_shared_state_round_trip_seconds{op}`` (each
worker's metrics port for ``redis2``): round trips per request, ops per batch, Redis time per request, and
how long an admission waited for its answer.

Cores (``taskset``, with two or more): a guard process on core 0; the load generator, the upstream and
Redis on core 1. ``redis2``'s workers get cores 0 and 1, so on a two-core machine its second worker shares
core 1 with the load generator, the upstream and Redis: the ratio then measures the machine, not the
guard, and the report says so. With four or more cores the load side moves to cores 2.. and each worker
has a core of its own.

    .venv/bin/python bench/guard_scale.py [--duration 10] [--rounds 3] [--json PATH]
    .venv/bin/python bench/guard_scale.py --quick      # one round of 1 s: checks that it runs
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
import yaml
from fast_upstream import completion_body
from guard_overhead import API_KEY, check_relays, measure, side_by_side, summarize, workloads
from loadgen import generator
from nginx_proxy import available as nginx_available
from nginx_proxy import start_nginx
from run_info import command, describe, write_report
from stack import REPO, Service, free_port, guard_has_telemetry, pinned, start, start_guard

from guard.state.scripts import OPS

TARGET_SHARED_COST = 0.15  # redis1 loses at most this share of alone's requests/s
TARGET_TWO_WORKERS = 1.6  # redis2 / redis1 requests/s
ROUND_TRIP = "guard_shared_state_round_trip_seconds"


def cores() -> tuple[str | None, str | None, str | None]:
    """(one guard process, two workers, the load side) as taskset lists; all None when not pinning."""
    count = os.cpu_count() or 1
    if shutil.which("taskset") is None or count < 2:
        return None, None, None
    if count >= 4:
        return "0", "0,1", f"2-{count - 1}"
    return "0", "0,1", "1"


def start_redis(workdir: Path, cpus: str | None) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("guard_scale: redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    log = (workdir / "redis.log").open("wb")
    process = subprocess.Popen(pinned([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", str(workdir)], cpus),
                               stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(16).startswith(b"+PONG"):
                    return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    process.kill()
    sys.exit("guard_scale: redis-server did not answer PING")


def start_workers(workdir: Path, config: dict, workers: int, cpus: str | None) -> tuple[Service, list[str]]:
    """``python -m guard --workers N``: the service, and each worker's own metrics URL."""
    port, metrics = free_port(), free_port()
    path = workdir / "guard-workers.yaml"
    path.write_text(yaml.safe_dump({**config, "listen": {"host": "127.0.0.1", "port": port}}))
    service = start("guard-workers", pinned([sys.executable, "-m", "guard", "--config", str(path), "--log-level",
                                             "WARNING", "--workers", str(workers), "--metrics-port",
                                             str(metrics)], cpus),
                    f"http://127.0.0.1:{port}", workdir, ready=guard_has_telemetry)
    urls = [f"http://127.0.0.1:{metrics + i}" for i in range(workers)]
    for url in urls:  # each worker listening, with telemetry and its link to Redis up
        deadline = time.monotonic() + 30
        while not _ready(url):
            if time.monotonic() > deadline:
                service.stop()
                raise RuntimeError(f"worker at {url} not ready:\n{service.tail()}")
            time.sleep(0.1)
    return service, urls


def _ready(url: str) -> bool:
    try:
        return guard_has_telemetry(url) and _samples(url).get("guard_shared_state_up", 0.0) == 1.0
    except OSError:
        return False


def _samples(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=2.0) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
            if line and not line.startswith("#")}


def round_trips(urls: list[str]) -> dict[str, tuple[float, float]]:
    """{op: (calls, seconds)} summed over ``urls`` (the processes of one target)."""
    total: dict[str, tuple[float, float]] = {}
    for url in urls:
        for name, value in _samples(url).items():
            for suffix, slot in (("_count", 0), ("_sum", 1)):
                if name.startswith(ROUND_TRIP + suffix + "{"):
                    op = name.split('op="', 1)[1].split('"', 1)[0]
                    calls, seconds = total.get(op, (0.0, 0.0))
                    total[op] = (calls + value, seconds) if slot == 0 else (calls, seconds + value)
    return total


def run(args: argparse.Namespace, workdir: Path) -> dict:
    one, two, load_cpus = cores()
    kind = args.load_generator if args.load_generator != "auto" else generator()
    [unary] = [load for load in workloads(32, 20.0, 256) if load.name == "unary"]
    port = free_port()
    python_upstream = start("upstream", pinned([sys.executable, str(REPO / "bench" / "fast_upstream.py"),
                                                "--port", str(port)], load_cpus), f"http://127.0.0.1:{port}", workdir)
    answers = {"/v1/completions": completion_body(unary.body["max_tokens"])}
    upstream = start_nginx(workdir, python_upstream.url, load_cpus, answers) if nginx_available() else python_upstream
    redis, redis_url = start_redis(workdir, load_cpus)
    proxies: dict[str, Service] = {}
    metrics: dict[str, list[str]] = {}
    try:
        config = {"engine": {"name": "primary", "url": upstream.url}, "secret": "bench-scale",
                  "tenants": [{"name": "bench", "api_keys": [API_KEY], "lane": "interactive", "max_queue": 100000}]}
        shared = {**config, "shared_state": {"redis_url": redis_url}}
        proxies["alone"] = start_guard(workdir, config, one, name="guard-alone")
        proxies["redis1"] = start_guard(workdir, shared, one, name="guard-redis1")
        metrics["redis1"] = [proxies["redis1"].url]
        proxies["redis2"], metrics["redis2"] = start_workers(workdir, shared, 2, two)
        targets = {"direct": upstream.url, **{name: p.url for name, p in proxies.items()}}
        check_relays(targets, [unary])
        results: dict[str, list[dict]] = {name: [] for name in targets}
        names = list(targets)
        for index in range(args.rounds):
            for name in names[index % len(names):] + names[:index % len(names)]:
                before = round_trips(metrics[name]) if name in metrics else {}
                figures = measure(kind, targets[name], unary, args, workdir, proxies.get(name), upstream,
                                  load_cpus)
                if name in metrics:
                    figures["redis"] = redis_per_request(before, round_trips(metrics[name]),
                                                         figures["load_generator_output"]["requests"])
                results[name].append(figures)
                print(f"  round {index + 1} {name:7} {figures['requests_per_s']:8,.0f} req/s "
                      f"p50 {figures['p50_ms']:7.2f} ms p99 {figures['p99_ms']:7.2f} ms", flush=True)
        paired = side_by_side(kind, [unary], args, workdir, proxies, upstream, load_cpus, ("alone", "redis1"))
    finally:
        for service in (*proxies.values(), upstream, python_upstream):  # stopping twice is harmless
            service.stop()
        redis.terminate()
        redis.wait(10)
    summary = summarize({"unary": results})["unary"]
    for name in metrics:
        summary[name]["redis"] = {key: statistics.median(r["redis"][key] for r in results[name])
                                  for key in results[name][0]["redis"]}
    return {
        "benchmark": "guard_scale", "machine": describe(torch.device("cpu")), "command": command(),
        "cpu_count": os.cpu_count(), "load_generator": kind,
        "layout": (f"one guard process on core {one}; redis2's two workers on cores {two}; load generator, "
                   f"upstream and Redis on core(s) {load_cpus}" if one else "not pinned"),
        "shares_a_core_with_the_load": two is not None and load_cpus is not None
        and bool(set(two.split(",")) & set(load_cpus.split(","))),
        "connections": args.connections, "duration_s": args.duration, "rounds": args.rounds,
        "workload": unary.body, "summary": summary, "verdicts": verdicts(summary, results, paired["unary"]),
        "rounds_raw": results, "side_by_side_cpu_ratios": paired["unary"],
    }


def redis_per_request(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]],
                      requests: int) -> dict[str, float]:
    """Round trips per request (``batch``es, which carry the requests' ops, and the lease's own), Redis time per
    request, and the mean wait for an admission's answer (its batch's round trip, and the one before it)."""
    def delta(op: str) -> tuple[float, float]:
        calls, seconds = after.get(op, (0.0, 0.0))
        return calls - before.get(op, (0.0, 0.0))[0], seconds - before.get(op, (0.0, 0.0))[1]
    trips = [delta(op) for op in after if op.upper() not in OPS]
    calls, seconds = sum(c for c, _ in trips), sum(s for _, s in trips)
    admits, admit_seconds = delta("admit")
    return {"calls_per_request": calls / max(1, requests),
            "ops_per_trip": sum(delta(op.lower())[0] for op in OPS) / max(1.0, delta("batch")[0]),
            "redis_ms_per_request": 1e3 * seconds / max(1, requests),
            "admit_mean_ms": 1e3 * admit_seconds / admits if admits else 0.0,
            "mean_round_trip_ms": 1e3 * seconds / calls if calls else 0.0}


def verdicts(summary: dict[str, dict], results: dict[str, list[dict]], paired: list[float]) -> dict:
    """Shared state's cost, from CPU per request measured side by side (``alone`` and ``redis1`` loaded at the
    same moment, so the machine's noise slows both alike): a guard that is CPU-bound serves 1/(CPU per
    request), so it loses 1 - 1/ratio of its requests/s. Two workers over one: the median of the rounds'
    ratios (each round measures both within a minute), and what the CPU per request says two workers would
    serve with a core each and the load elsewhere (2 x one's CPU per request / two's)."""
    alone, one = (summary[name]["requests_per_s"] for name in ("alone", "redis1"))
    cost = 1 - 1 / statistics.median(paired)
    per_round = [two["requests_per_s"] / one["requests_per_s"]
                 for one, two in zip(results["redis1"], results["redis2"], strict=True)]
    measured = statistics.median(per_round)
    cores_each = 2 * summary["redis1"]["proxy_cpu_us_per_request"] / summary["redis2"]["proxy_cpu_us_per_request"]
    return {"shared_state_cost": cost, "shared_state_cost_target": TARGET_SHARED_COST,
            "shared_state_cost_met": cost < TARGET_SHARED_COST,
            "shared_state_cost_from_medians": 1 - one / alone,
            "two_workers_over_one": measured, "two_workers_over_one_per_round": per_round,
            "two_workers_target": TARGET_TWO_WORKERS, "two_workers_met": measured >= TARGET_TWO_WORKERS,
            "two_workers_with_a_core_each": cores_each}


def table(summary: dict[str, dict]) -> str:
    head = (f"{'target':7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'+p99 ms':>8} {'guard CPU':>9} "
            f"{'CPU us/req':>10} {'trips/req':>9} {'ops/trip':>8} {'Redis ms/req':>12} {'ADMIT ms':>9} {'errors':>6}")
    rows = [head, "-" * len(head)]
    for name, r in summary.items():
        redis = r.get("redis")
        rows.append(f"{name:7} {r['requests_per_s']:>8,.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                    f"{_fmt(r['added_p99_ms'], '+.2f'):>8} {_fmt(r['proxy_cpu'], '.0%'):>9} "
                    f"{_fmt(r['proxy_cpu_us_per_request'], ',.0f'):>10} "
                    f"{_fmt(redis and redis['calls_per_request'], '.2f'):>9} "
                    f"{_fmt(redis and redis['ops_per_trip'], '.1f'):>8} "
                    f"{_fmt(redis and redis['redis_ms_per_request'], '.3f'):>12} "
                    f"{_fmt(redis and redis['admit_mean_ms'], '.3f'):>9} {r['errors']:>6}")
    return "\n".join(rows)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round of 1 s measurements: checks that it runs")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--load-generator", choices=["auto", "wrk", "python"], default="auto")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "guard_scale.json")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.rounds = 1.0, 1
    with tempfile.TemporaryDirectory(prefix="guard-scale-") as workdir:
        report = run(args, Path(workdir))
    print(f"machine: {report['machine']}")
    print(f"command: {report['command']}")
    if args.quick:
        print("QUICK RUN: 1-second measurements, not a measurement")
    print(f"load generator: {report['load_generator']}; {report['layout']}")
    print(table(report["summary"]))
    v = report["verdicts"]
    print(f"shared state costs {v['shared_state_cost']:.1%} of one guard's requests/s, from its CPU per request "
          f"side by side (target < {TARGET_SHARED_COST:.0%}; from the medians above: "
          f"{v['shared_state_cost_from_medians']:.1%})")
    print(f"2 workers serve {v['two_workers_over_one']:.2f}x one (median of the rounds; target >= "
          f"{TARGET_TWO_WORKERS}x); with a core each, by CPU per request: {v['two_workers_with_a_core_each']:.2f}x")
    if report["shares_a_core_with_the_load"]:
        print("note: the second worker shares a core with the load generator, the upstream and Redis: the "
              "2-worker ratio is bounded by this machine's cores, not by the guard")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_report(args.json, report)
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
