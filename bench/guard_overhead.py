"""Guard overhead: the guard vs nginx vs a bare aiohttp relay vs no proxy, in front of the same fast upstream,
in one run.

The upstream (bench/fast_upstream.py, a process of its own) answers from memory, so what a proxy costs is
not hidden behind model time. With two or more cores the work is pinned with ``taskset``:

    core 0   the proxy under test: the guard (one process, one event loop), nginx (one worker), or
             bench/bare_relay.py ("aiohttp": the least an aiohttp proxy does, the floor of the guard's cost)
    core 1   the load generator (wrk, else bench/http_load.py) and the upstream

"direct" sends straight to the upstream. Three workloads, each closed-loop with ``--connections`` (64)
requests in flight for ``--duration`` seconds, repeated ``--rounds`` times with the targets in rotating
order; medians are reported, and added latency is taken against the direct run of the same round:

- unary: non-streamed completions: requests/s on one core. Target: the guard >= 1/3 of nginx.
- stream: streamed completions of 32 token events 20 ms apart (a 50 tokens/s decode), so 64 concurrent
  streams, their starts spread at random over one stream's length; latency of a whole stream, added
  p50/p99 over direct. Target: added p99 <= 5 ms.
- firehose: streamed completions of 256 events back to back: SSE events/s relayed.

"pool3" is the guard with a pool of three replicas (the same upstream under three names, each with its own
telemetry and KV-event subscription, every request scored by the kvguard picker). Target: its CPU per
request within 10% of the guard's with a pool of one.

"traced" (with ``--tracing``) is the guard exporting OpenTelemetry spans: ``OTEL_EXPORTER_OTLP_ENDPOINT``
points at a throwaway OTLP/HTTP receiver (this file run with ``--otlp-sink PORT``, pinned with the load
generator, so that only the guard's side of tracing is charged to the proxy's core). Target: its CPU per
request (the exporter's thread included) within 10% of the guard's without tracing. Besides its rows in the
table, the two guards are then run side by side (both pinned to the proxy's core, each under the same load
at the same time, ``--rounds`` times per workload), so that the machine's drift falls on both and their
ratio resolves a few percent even on a busy machine; the verdict is the median of those ratios.

For each proxy the report also gives its CPU per request, which a busy shared machine does not distort the
way it distorts requests/s, and the time it spent runnable but waiting for its core (bench/proc_stats.py).
The guard runs with one tenant and the upstream's telemetry (a pool that never fills), so every request
takes its whole path: auth, validation, token counting, fair queue, admission, relay. Before
measuring, every proxy must relay the upstream's bytes exactly. Without nginx on PATH the run compares the
guard with direct only, and says so.

    .venv/bin/python bench/guard_overhead.py [--duration 10] [--rounds 5] [--json PATH]
    .venv/bin/python bench/guard_overhead.py --quick      # one round of 1 s: checks that it runs
    .venv/bin/python bench/guard_overhead.py --tracing    # also the guard with tracing on, side by side
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from loadgen import generator, run_load
from nginx_proxy import available as nginx_available
from nginx_proxy import start_nginx
from proc_stats import sched_seconds
from run_info import command, describe, write_report
from stack import REPO, Service, free_port, pinned, start, start_bare_relay, start_guard

API_KEY = "sk-bench-overhead"
PROMPT = "benchmark prompt"
TARGET_RPS_SHARE_OF_NGINX = 1 / 3
TARGET_ADDED_P99_MS = 5.0
TARGET_POOL3_CPU_RATIO = 1.10
TARGET_TRACED_CPU_RATIO = 1.10
FIGURES = ("requests_per_s", "events_per_s", "p50_ms", "p99_ms", "mean_ms", "proxy_cpu",
           "proxy_cpu_us_per_request", "proxy_wait_ms_per_s", "upstream_cpu")


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    body: dict
    events: int  # token events per response (0: not streamed)
    stagger: float = 0.0  # seconds over which the connections' first requests are spread (see loadgen.py)


def workloads(stream_events: int, interval_ms: float, firehose_events: int) -> list[Workload]:
    base = {"model": "tiny", "prompt": PROMPT, "temperature": 0.0}
    return [
        Workload("unary", {**base, "max_tokens": 16}, 0),
        Workload("stream", {**base, "max_tokens": stream_events, "stream": True, "interval_ms": interval_ms},
                 stream_events, stream_events * interval_ms / 1e3),
        Workload("firehose", {**base, "max_tokens": firehose_events, "stream": True, "interval_ms": 0},
                 firehose_events),
    ]


def post(url: str, body: dict) -> bytes:
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()


def check_relays(targets: dict[str, str], loads: list[Workload]) -> None:
    """Every proxy must hand back the upstream's bytes exactly, or its figures would not be comparable."""
    for load in loads:
        expected = post(targets["direct"], load.body)
        if load.events and expected.count(b"data: ") != load.events + 1:
            raise RuntimeError(f"the upstream sent {expected.count(b'data: ')} events for {load.name}")
        for name, url in targets.items():
            if (got := post(url, load.body)) != expected:
                raise RuntimeError(f"{name} relayed a different body for {load.name}: {got[:200]!r}")


def measure(kind: str, url: str, load: Workload, args: argparse.Namespace, workdir: Path,
            proxy: Service | None, upstream: Service, load_cpus: str | None) -> dict:
    """One load against one target, with the scheduler's view of the proxy and the upstream meanwhile."""
    upstream_start = sched_seconds(upstream.process.pid)
    proxy_start = sched_seconds(proxy.process.pid) if proxy else (0.0, 0.0)
    result = run_load(kind, url + "/v1/completions", json.dumps(load.body).encode(),
                      {"Authorization": f"Bearer {API_KEY}"}, args.connections, args.duration, workdir,
                      load_cpus, load.stagger)
    upstream_cpu = sched_seconds(upstream.process.pid)[0] - upstream_start[0]
    proxy_end = sched_seconds(proxy.process.pid) if proxy else (0.0, 0.0)
    cpu, wait = proxy_end[0] - proxy_start[0], proxy_end[1] - proxy_start[1]
    seconds = result["duration_us"] / 1e6
    rps = result["requests"] / seconds
    return {
        "requests_per_s": rps, "events_per_s": rps * load.events,
        "p50_ms": result["latency_us"]["p50"] / 1e3, "p99_ms": result["latency_us"]["p99"] / 1e3,
        "mean_ms": result["latency_us"]["mean"] / 1e3, "errors": sum(result["errors"].values()),
        "proxy_cpu": cpu / seconds if proxy else None,
        "proxy_cpu_us_per_request": 1e6 * cpu / max(1, result["requests"]) if proxy else None,
        "proxy_wait_ms_per_s": 1e3 * wait / seconds if proxy else None,
        "upstream_cpu": upstream_cpu / seconds, "load_generator_output": result,
    }


def side_by_side(kind: str, loads: list[Workload], args: argparse.Namespace, workdir: Path,
                 proxies: dict[str, Service], upstream: Service, load_cpus: str | None,
                 pair: tuple[str, str] = ("guard", "traced")) -> dict[str, list[float]]:
    """CPU per request of proxy ``pair[1]`` over proxy ``pair[0]`` (by default the guard with tracing over the
    guard without), both loaded at the same time: whatever slows the machine slows both alike."""
    base, other = pair
    ratios: dict[str, list[float]] = {load.name: [] for load in loads}
    for index in range(args.rounds):
        for load in loads:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                runs = {name: pool.submit(measure, kind, proxies[name].url, load, args, workdir, proxies[name],
                                          upstream, load_cpus) for name in pair}
            off, on = (runs[name].result()["proxy_cpu_us_per_request"] for name in pair)
            ratios[load.name].append(on / off)
            print(f"  side by side {index + 1} {load.name:8} {base} {off:7,.0f} us/req, {other} {on:7,.0f} us/req: "
                  f"{on / off:.3f}x", flush=True)
    return ratios


def summarize(results: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, dict]]:
    """Medians over rounds; added latency per round against that round's direct run, then the median."""
    summary: dict[str, dict[str, dict]] = {}
    for workload, by_target in results.items():
        summary[workload] = {}
        for target, rounds in by_target.items():
            row: dict = {}
            for key in FIGURES:
                values = [r[key] for r in rounds if r[key] is not None]
                row[key] = statistics.median(values) if values else None
            row["errors"] = sum(r["errors"] for r in rounds)
            for figure in ("p50_ms", "p99_ms"):
                added = [r[figure] - d[figure] for r, d in zip(rounds, by_target["direct"])]
                row[f"added_{figure}"] = statistics.median(added) if target != "direct" else None
            summary[workload][target] = row
    return summary


def verdicts(summary: dict[str, dict[str, dict]]) -> dict:
    guard, nginx, bare = summary["unary"]["guard"], summary["unary"].get("nginx"), summary["unary"]["aiohttp"]
    share = guard["requests_per_s"] / nginx["requests_per_s"] if nginx else None
    # What each could serve with a core to itself: nginx is often held back by the upstream, not its core.
    per_cpu = nginx["proxy_cpu_us_per_request"] / guard["proxy_cpu_us_per_request"] if nginx else None
    added = summary["stream"]["guard"]["added_p99_ms"]
    pool3 = summary["unary"]["pool3"]["proxy_cpu_us_per_request"] / guard["proxy_cpu_us_per_request"]
    return {
        "pool3_cpu_per_request_ratio": pool3,
        "pool3_cpu_ratio_target": TARGET_POOL3_CPU_RATIO,
        "pool3_cpu_ratio_met": pool3 <= TARGET_POOL3_CPU_RATIO,
        **({f"traced_cpu_per_request_ratio_{load}": summary[load]["traced"]["proxy_cpu_us_per_request"]
            / summary[load]["guard"]["proxy_cpu_us_per_request"] for load in summary}
           if "traced" in summary["unary"] else {}),
        "guard_rps_share_of_nginx": share,
        "guard_rps_share_of_nginx_per_cpu_second": per_cpu,
        "guard_rps_share_target": TARGET_RPS_SHARE_OF_NGINX,
        "guard_rps_share_met": None if share is None else share >= TARGET_RPS_SHARE_OF_NGINX,
        "bare_aiohttp_rps_share_of_nginx": bare["requests_per_s"] / nginx["requests_per_s"] if nginx else None,
        "guard_cpu_share_spent_in_a_bare_relay": bare["proxy_cpu_us_per_request"] / guard["proxy_cpu_us_per_request"],
        "guard_added_p99_ms_at_stream_load": added,
        "guard_added_p99_target_ms": TARGET_ADDED_P99_MS,
        "guard_added_p99_met": added <= TARGET_ADDED_P99_MS,
    }


def table(summary: dict[str, dict[str, dict]]) -> str:
    head = (f"{'workload':9} {'target':7} {'req/s':>8} {'events/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
            f"{'+p50 ms':>8} {'+p99 ms':>8} {'proxy CPU':>9} {'CPU us/req':>10} {'wait ms/s':>9} "
            f"{'upstr CPU':>9} {'errors':>6}")
    rows = [head, "-" * len(head)]
    for workload, by_target in summary.items():
        for target, r in by_target.items():
            rows.append(
                f"{workload:9} {target:7} {r['requests_per_s']:>8,.0f} "
                f"{_fmt(r['events_per_s'] or None, ',.0f'):>9} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                f"{_fmt(r['added_p50_ms'], '+.2f'):>8} {_fmt(r['added_p99_ms'], '+.2f'):>8} "
                f"{_fmt(r['proxy_cpu'], '.0%'):>9} {_fmt(r['proxy_cpu_us_per_request'], ',.0f'):>10} "
                f"{_fmt(r['proxy_wait_ms_per_s'], ',.0f'):>9} {r['upstream_cpu']:>9.0%} {r['errors']:>6}")
    return "\n".join(rows)


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Variables for the processes started inside (``start`` passes its own environment on)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def otlp_sink(port: int) -> None:
    """A throwaway OTLP/HTTP receiver: accepts ``POST /v1/traces`` and counts the spans (``GET /spans``)."""
    from aiohttp import web
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received = 0

    async def traces(request: web.Request) -> web.Response:
        nonlocal received
        export = ExportTraceServiceRequest.FromString(await request.read())
        received += sum(len(s.spans) for r in export.resource_spans for s in r.scope_spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def count(_: web.Request) -> web.Response:
        return web.json_response(received)

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/spans", count)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _spans_received(url: str) -> int:
    with urllib.request.urlopen(url + "/spans", timeout=5) as response:
        return json.load(response)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def run(args: argparse.Namespace, workdir: Path) -> dict:
    pin = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2
    proxy_cpus, load_cpus = ("0", "1") if pin else (None, None)
    kind = args.load_generator if args.load_generator != "auto" else generator()
    loads = workloads(args.stream_events, args.interval_ms, args.firehose_events)
    port = free_port()
    upstream = start("upstream", pinned([sys.executable, str(REPO / "bench" / "fast_upstream.py"), "--port",
                                         str(port)], load_cpus), f"http://127.0.0.1:{port}", workdir)
    proxies: dict[str, Service] = {}
    services: list[Service] = []  # helpers that are not proxies (the OTLP sink)
    try:
        tenants = [{"name": "bench", "api_keys": [API_KEY], "lane": "interactive", "max_queue": 100000}]
        proxies["guard"] = start_guard(workdir, {
            "engine": {"name": "primary", "url": upstream.url}, "secret": "bench-overhead", "tenants": tenants,
        }, proxy_cpus)
        proxies["pool3"] = start_guard(workdir, {
            "engines": [{"name": f"r{i}", "url": upstream.url} for i in range(3)], "secret": "bench-overhead",
            "tenants": tenants,
        }, proxy_cpus, name="guard-pool3")
        if args.tracing:
            sink_port = free_port()
            sink = start("otlp-sink", pinned([sys.executable, str(Path(__file__).resolve()), "--otlp-sink",
                                              str(sink_port)], load_cpus), f"http://127.0.0.1:{sink_port}", workdir)
            services.append(sink)
            with _environment(OTEL_EXPORTER_OTLP_ENDPOINT=sink.url):  # this guard's alone
                proxies["traced"] = start_guard(workdir, {
                    "engine": {"name": "primary", "url": upstream.url}, "secret": "bench-overhead",
                    "tenants": tenants}, proxy_cpus, name="guard-traced")
        if nginx_available():
            proxies["nginx"] = start_nginx(workdir, upstream.url, proxy_cpus)
        proxies["aiohttp"] = start_bare_relay(workdir, upstream.url, proxy_cpus)
        targets = {"direct": upstream.url, **{name: p.url for name, p in proxies.items()}}
        check_relays(targets, loads)
        names = list(targets)
        results: dict[str, dict[str, list[dict]]] = {load.name: {name: [] for name in names}
                                                      for load in loads}
        for index in range(args.rounds):
            order = names[index % len(names):] + names[:index % len(names)]  # spread the machine's drift
            for load in loads:
                for name in order:
                    figures = measure(kind, targets[name], load, args, workdir, proxies.get(name), upstream,
                                      load_cpus)
                    results[load.name][name].append(figures)
                    print(f"  round {index + 1} {load.name:8} {name:6} "
                          f"{figures['requests_per_s']:8,.0f} req/s p50 {figures['p50_ms']:7.2f} ms "
                          f"p99 {figures['p99_ms']:7.2f} ms", flush=True)
        paired = side_by_side(kind, loads, args, workdir, proxies, upstream, load_cpus) if args.tracing else {}
    finally:
        spans = _spans_received(services[0].url) if services else None
        for service in (*proxies.values(), *services, upstream):
            service.stop()
    summary = summarize(results)
    return {
        "benchmark": "guard_overhead", "machine": describe(torch.device("cpu")), "command": command(),
        "load_average_1m_at_end": os.getloadavg()[0], "load_generator": kind,
        "layout": ("proxy pinned to core 0; load generator and upstream pinned to core 1" if pin
                   else "not pinned (taskset missing or a single core)"),
        "nginx": "nginx, one worker" if "nginx" in proxies else "not installed: guard vs direct only",
        "connections": args.connections, "duration_s": args.duration, "rounds": args.rounds,
        "workloads": {load.name: load.body for load in loads},
        "summary": summary, "verdicts": verdicts(summary), "rounds_raw": results, "otlp_spans_received": spans,
        "traced_side_by_side_cpu_ratios": paired,
        "traced_side_by_side_cpu_ratio_median": {name: statistics.median(r) for name, r in paired.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per measurement")
    # Five: on a shared VM a 10-s run's p99 moves by tens of ms from one round to the next, for every target
    # alike, and the median of three could flip a 5 ms verdict either way.
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true",
                        help="one round of 1 s measurements: checks that it runs")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--stream-events", type=int, default=32)
    parser.add_argument("--interval-ms", type=float, default=20.0, help="gap between a paced stream's events")
    parser.add_argument("--firehose-events", type=int, default=256)
    parser.add_argument("--load-generator", choices=["auto", "wrk", "python"], default="auto")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "guard_overhead.json")
    parser.add_argument("--tracing", action="store_true",
                        help="also measure a guard exporting OpenTelemetry spans to a throwaway OTLP receiver")
    parser.add_argument("--otlp-sink", type=int, metavar="PORT", help=argparse.SUPPRESS)  # that receiver
    args = parser.parse_args()
    if args.otlp_sink is not None:
        otlp_sink(args.otlp_sink)
        return
    if args.quick:
        args.duration, args.rounds = 1.0, 1
    started_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="guard-overhead-") as workdir:
        report = run(args, Path(workdir))
    report["load_average_1m_at_start"] = started_load
    print(f"machine: {report['machine']}; load average {started_load:.2f} at start, "
          f"{report['load_average_1m_at_end']:.2f} at end")
    print(f"command: {report['command']}")
    if args.quick:
        print("QUICK RUN: 1-second measurements, not a measurement")
    print(f"load generator: {report['load_generator']}; {report['layout']}; nginx: {report['nginx']}")
    print(table(report["summary"]))
    v = report["verdicts"]
    share = v["guard_rps_share_of_nginx"]
    print("guard requests/s vs nginx: " + ("n/a (nginx not installed)" if share is None else
          f"{share:.2f} measured, {v['guard_rps_share_of_nginx_per_cpu_second']:.2f} per CPU second "
          f"(target >= {TARGET_RPS_SHARE_OF_NGINX:.2f})"))
    if share is not None:
        print(f"a bare aiohttp relay vs nginx: {v['bare_aiohttp_rps_share_of_nginx']:.2f}; of the guard's CPU per "
              f"request, {v['guard_cpu_share_spent_in_a_bare_relay']:.0%} is what the bare relay spends")
    print(f"guard CPU per request, pool of 3 vs pool of 1: {v['pool3_cpu_per_request_ratio']:.2f}x "
          f"(target <= {TARGET_POOL3_CPU_RATIO:.2f}x)")
    if args.tracing:
        ratios = ", ".join(f"{key.rsplit('_', 1)[1]} {value:.2f}x" for key, value in v.items()
                           if key.startswith("traced_cpu_per_request_ratio_"))
        paired = ", ".join(f"{name} {value:.3f}x" for name, value in
                           report["traced_side_by_side_cpu_ratio_median"].items())
        print(f"guard CPU per request, tracing on vs off: in the table {ratios}; side by side (medians) {paired} "
              f"(target <= {TARGET_TRACED_CPU_RATIO:.2f}x); spans received by the OTLP sink: "
              f"{report['otlp_spans_received']:,}")
    print(f"guard added p99 at {args.connections} concurrent streams: "
          f"{v['guard_added_p99_ms_at_stream_load']:+.2f} ms (target <= {TARGET_ADDED_P99_MS:g} ms)")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_report(args.json, report)
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
