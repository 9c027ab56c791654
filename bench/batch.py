"""A batch beside interactive load, side by side with the same interactive load alone.

One engine (``python -m engine --model tiny --num-blocks N``) behind one guard with the Batch API (embedded
store). Each round runs two phases, in alternating order (a shared machine's drift weighs on both alike):

  alone    the interactive tenant ``web`` sends streamed completions through the guard, open loop (Poisson
           arrivals, bench/tenant_load.py) at ``--web-share`` of the engine's capacity, for ``--duration`` s;
  beside   the same arrivals (same seed) while a batch of ``--batch-lines`` completions from the tenant
           ``bulk`` runs through the guard's Batch API (created, and given ``--settle`` s to fill the engine,
           before the arrivals start; cancelled after them).

The capacity is the engine's generated tokens per second when saturated straight on with requests of the
batch's shape: its best over ``--capacity-concurrency`` requests in flight (32 and 64: on this CPU 64 gave
less than 32), measured before and after each round (their mean; on a shared machine the two can differ by
2x, which the report shows). Reported per phase: the interactive TTFT (from the scheduled arrival to the
first token event: p50, p90, p99), the engine's generated tokens per second in all and per tenant (its own
per-tenant counters: the guard names the tenant to the engine), and ``why`` (bench/phase_probe.py): the
engine's steps and their mean time, the sequences it ran, the interactive tenant's mean wait in the guard's
queue, and each process's CPU. The batch's throughput is the engine's tokens per second for ``bulk`` beside;
the capacity interactive work leaves is the capacity less the engine's tokens per second for ``web`` alone.
The issue's targets: the interactive TTFT median beside a batch within 1.2x of alone, and the batch at >= 80%
of the capacity interactive work leaves. That capacity is also measured side by side, once per round
(``left_measured_tokens_per_s``): the batch-shaped requests' tokens per second, straight to the engine at each
``--capacity-concurrency`` level, while the round's interactive arrivals run through the guard. It charges
the interactive requests what they cost the engine, where the capacity less their tokens counts a streamed
token as a batch token (on this CPU the two agreed within 6 %: docs/benchmarks/batch.md).

With taskset and 2 cores, the engine runs alone on core 0 and the guard with this process (the load
generator) on core 1 (``--no-pin``: all three float); pinning keeps them from taking each other's core, not
other programs off theirs.

    flock /tmp/kvguard-bench.lock .venv/bin/python bench/batch.py [--duration 30] [--rounds 2] [--json PATH]
    .venv/bin/python bench/batch.py --quick     # one short round: checks that it runs
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import torch
from latency import summarize
from phase_probe import Probe
from run_info import command, describe, write_report
from stack import REPO, Service, get_json, start_engine, start_guard
from tenant_load import Result, arrivals, engine_target, guard_target, send, status_counts

KEYS = {"web": "sk-bench-web", "bulk": "sk-bench-bulk"}
SERIAL = itertools.count()  # distinct prompts: no request hits another's prefix cache


def web_body(max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": f"{next(SERIAL):07d} where is my order? " * 2, "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}


def batch_file(lines: int, max_tokens: int) -> bytes:
    return b"".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions", "body": {
        "model": "tiny", "prompt": f"{next(SERIAL):07d} summarize part {i}:",
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}).encode() + b"\n" for i in range(lines))


def tokens_total(engine: Service) -> dict[str, float]:
    """The engine's generated tokens so far: in all (``all``), and per tenant the guard named (``web``,
    ``bulk``: the engine counts each tenant's tokens, so the batch's are told from the interactive ones
    exactly, including those of requests still running when a phase ends)."""
    snapshot = get_json(engine.url + "/telemetry")
    tenants = snapshot["tenants"]
    return {"all": snapshot["generation_tokens_total"],
            **{name: tenants.get(name, {}).get("generation_tokens_total", 0) for name in KEYS}}


def rates(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    return {key: (after[key] - before[key]) / seconds for key in before}


async def wait_idle(engine: Service, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        snap = await asyncio.to_thread(get_json, engine.url + "/telemetry")
        if snap["num_running"] + snap["num_waiting"] + snap["num_swapped"] == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine is still busy {timeout:g} s on")
        await asyncio.sleep(0.1)


async def saturate(engine: Service, max_tokens: int, seconds: float, concurrency: int,
                   alongside: Callable[[float], Awaitable[None]] | None = None) -> dict[str, float]:
    """Generated tokens per second, in all and per tenant, with ``concurrency`` batch-shaped requests of the
    tenant ``bulk`` in flight straight to the engine (which counts them as ``bulk``'s: the header the guard
    sets), while ``alongside(seconds of warm-up and measurement)`` runs, if given."""
    body = json.loads(batch_file(1, max_tokens))["body"]
    headers = engine_target(engine.url, ["bulk"]).headers["bulk"]
    warm_up = min(2.0, seconds / 2)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker() -> None:
            while True:
                async with session.post(engine.url + "/v1/completions", json=body, headers=headers) as answer:
                    await answer.read()
        beside = asyncio.create_task(alongside(warm_up + seconds)) if alongside is not None else None
        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        await asyncio.sleep(warm_up)
        before, started = await asyncio.to_thread(tokens_total, engine), time.monotonic()
        await asyncio.sleep(seconds)
        after, elapsed = await asyncio.to_thread(tokens_total, engine), time.monotonic() - started
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        if beside is not None:
            await beside
    await wait_idle(engine)
    return rates(before, after, elapsed)


async def capacity(engine: Service, args: argparse.Namespace) -> dict[str, float]:
    """The engine's capacity: its best generated tokens/s over ``--capacity-concurrency`` (on this CPU the
    step time grows faster than linearly past ~32 sequences, so 64 in flight gave less than 32); each level's
    figure is kept in the report."""
    if args.capacity:
        return {"given": args.capacity}
    return {str(n): (await saturate(engine, args.batch_max_tokens, args.calibrate, n))["all"]
            for n in args.capacity_concurrency}


async def left_measured(engine: Service, guard: Service, args: argparse.Namespace, rate: float,
                        seed: int) -> dict[str, float]:
    """The capacity interactive work leaves, measured side by side: the batch-shaped requests' tokens/s at
    each ``--capacity-concurrency`` level, straight to the engine, while the round's interactive arrivals
    (same rate and seed) run through the guard. Unlike the capacity less the interactive tokens, it charges
    the interactive requests what they cost the engine, whatever a streamed token costs beside a batch token."""
    async def web(seconds: float) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            tasks = await web_arrivals(session, guard, args, rate, seed, time.monotonic(), seconds, [])
            await asyncio.wait(tasks, timeout=args.drain) if tasks else None

    return {str(n): (await saturate(engine, args.batch_max_tokens, args.calibrate, n, web))["bulk"]
            for n in args.capacity_concurrency}


async def start_batch(session: aiohttp.ClientSession, guard: Service, args: argparse.Namespace) -> str:
    headers = {"Authorization": f"Bearer {KEYS['bulk']}"}
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", batch_file(args.batch_lines, args.batch_max_tokens), filename="bench.jsonl")
    async with session.post(guard.url + "/v1/files", data=form, headers=headers) as answer:
        file = await answer.json()
        assert answer.status == 200, file
    async with session.post(guard.url + "/v1/batches", headers=headers, json={
            "input_file_id": file["id"], "endpoint": "/v1/completions", "completion_window": "24h"}) as answer:
        batch = await answer.json()
        assert answer.status == 200, batch
    return batch["id"]


async def stop_batch(session: aiohttp.ClientSession, guard: Service, batch_id: str) -> dict:
    headers = {"Authorization": f"Bearer {KEYS['bulk']}"}
    async with session.post(f"{guard.url}/v1/batches/{batch_id}/cancel", headers=headers) as answer:
        await answer.read()
    while True:
        async with session.get(f"{guard.url}/v1/batches/{batch_id}", headers=headers) as answer:
            batch = await answer.json()
        if batch["status"] in ("cancelled", "completed", "failed", "expired"):
            return batch
        await asyncio.sleep(0.2)


async def web_arrivals(session: aiohttp.ClientSession, guard: Service, args: argparse.Namespace, rate: float,
                       seed: int, start: float, seconds: float, results: list[Result]) -> list[asyncio.Task]:
    """The interactive tenant's streamed completions through the guard, Poisson arrivals at ``rate`` from
    ``start`` for ``seconds`` (the same ``seed``, the same times), each a task recording into ``results``."""
    target = guard_target(guard.url, KEYS)

    async def fire(result: Result) -> None:
        await send(session, target, "web", web_body(args.web_max_tokens), result)

    return await arrivals(rate, seed, start, seconds, fire, results)


async def phase(engine: Service, guard: Service, args: argparse.Namespace, rate: float, seed: int,
                with_batch: bool) -> dict:
    """One phase (see the module): the interactive arrivals, beside a batch or alone."""
    results: list[Result] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        batch_id = await start_batch(session, guard, args) if with_batch else None
        if batch_id is not None:
            await asyncio.sleep(args.settle)
        pids = {"engine": (engine.process.pid, True), "guard": (guard.process.pid, True),
                "load generator": (os.getpid(), False)}
        async with Probe(engine.url, guard.url, "web", pids) as probe:
            before, start = await asyncio.to_thread(tokens_total, engine), time.monotonic()
            tasks = await web_arrivals(session, guard, args, rate, seed, start, args.duration, results)
            await asyncio.sleep(max(0.0, start + args.duration - time.monotonic()))
            after, elapsed = await asyncio.to_thread(tokens_total, engine), time.monotonic() - start
        await asyncio.wait(tasks, timeout=args.drain) if tasks else None
        batch = await stop_batch(session, guard, batch_id) if batch_id is not None else None
    await wait_idle(engine)
    served = rates(before, after, elapsed)
    return {"with_batch": with_batch, "engine_tokens_per_s": served["all"], "web_tokens_per_s": served["web"],
            "batch_tokens_per_s": served["bulk"],
            "ttft": summarize([r.first_token - r.arrival for r in results if r.first_token is not None]),
            "statuses": status_counts(results), "batch_request_counts": batch and batch["request_counts"],
            "load_average_1m": os.getloadavg()[0], "why": probe.report}


def layout(pin: bool) -> tuple[str | None, str | None]:
    """With ``pin`` (and taskset, and 2 cores): the engine alone on core 0; the guard and this process (the
    load generator) on core 1, as bench/guard_ab.py pins. Unpinned, the three contend for both cores and the
    engine's steps wait for a CPU (each phase's ``why.cpu`` shows how long)."""
    if not (pin and shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2):
        return None, None
    os.sched_setaffinity(0, {1})
    return "0", "1"


async def run(args: argparse.Namespace, workdir: Path) -> dict:
    engine_cpus, guard_cpus = layout(args.pin)
    engine = start_engine(workdir, ["--model", "tiny", "--device", "cpu", "--num-blocks", str(args.num_blocks)],
                          engine_cpus)
    config = {"engine": {"name": "primary", "url": engine.url}, "secret": "bench-batch",
              "batch": {"store": str(workdir / "batches"), "max_in_flight": args.max_in_flight,
                        **({"max_slowdown": args.max_slowdown} if args.max_slowdown else {})},
              "tenants": [{"name": "web", "api_keys": [KEYS["web"]], "lane": "interactive", "max_queue": 256},
                          {"name": "bulk", "api_keys": [KEYS["bulk"]], "lane": "batch"}]}
    guard = start_guard(workdir, config, guard_cpus)
    rounds = []
    try:
        for index in range(args.rounds):
            before = await capacity(engine, args)
            rate = args.web_share * max(before.values()) / args.web_max_tokens
            phases = {}
            for with_batch in ((False, True) if index % 2 == 0 else (True, False)):
                phases["beside" if with_batch else "alone"] = await phase(engine, guard, args, rate, args.seed + index,
                                                                          with_batch)
            left = await left_measured(engine, guard, args, rate, args.seed + index)
            after = await capacity(engine, args)
            rounds.append({"capacity_tokens_per_s": (max(before.values()) + max(after.values())) / 2,
                           "capacity_before_after": [before, after], "left_measured_tokens_per_s": left,
                           "web_rate_per_s": rate, **phases})
            print(f"  round {index + 1}/{args.rounds}: {row(rounds[-1])}", flush=True)
    finally:
        guard.stop()
        engine.stop()
    return {"rounds": rounds, "summary": summary(rounds)}


def figures(one: dict) -> tuple[float, float, float, float]:
    """(TTFT p50 beside over alone, batch tokens/s, the capacity interactive work leaves: the capacity less
    the interactive tokens/s alone, and as measured side by side) of one round."""
    alone, beside = one["alone"], one["beside"]
    ratio = beside["ttft"]["p50_ms"] / alone["ttft"]["p50_ms"]
    batch_tps = beside["batch_tokens_per_s"]
    left = one["capacity_tokens_per_s"] - alone["web_tokens_per_s"]
    return ratio, batch_tps, left, max(one["left_measured_tokens_per_s"].values())


def row(one: dict) -> str:
    ratio, batch_tps, left, measured = figures(one)
    return (f"capacity {one['capacity_tokens_per_s']:.0f} tok/s; TTFT p50 alone {one['alone']['ttft']['p50_ms']:.0f} ms,"
            f" beside {one['beside']['ttft']['p50_ms']:.0f} ms ({ratio:.2f}x); batch {batch_tps:.0f} tok/s of"
            f" {left:.0f} left ({batch_tps / left:.0%}), of {measured:.0f} measured left ({batch_tps / measured:.0%})")


def summary(rounds: list[dict]) -> dict:
    ratios, shares, measured_shares = [], [], []
    for one in rounds:
        ratio, batch_tps, left, measured = figures(one)
        ratios.append(ratio)
        shares.append(batch_tps / left)
        measured_shares.append(batch_tps / measured)
    return {"ttft_p50_beside_over_alone": statistics.median(ratios), "batch_share_of_left": statistics.median(shares),
            "batch_share_of_left_measured": statistics.median(measured_shares),
            "per_round": {"ttft_ratio": ratios, "batch_share_of_left": shares,
                          "batch_share_of_left_measured": measured_shares}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of interactive arrivals per phase")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--drain", type=float, default=10.0, help="seconds the arrivals' requests get after them")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds the batch runs before the arrivals")
    parser.add_argument("--web-share", type=float, default=0.2, help="of the capacity, offered by web")
    parser.add_argument("--web-max-tokens", type=int, default=32)
    parser.add_argument("--batch-lines", type=int, default=3000)
    parser.add_argument("--batch-max-tokens", type=int, default=64)
    parser.add_argument("--max-in-flight", type=int, default=64, help="batch.max_in_flight")
    parser.add_argument("--max-slowdown", type=float, help="batch.max_slowdown (default: unset)")
    parser.add_argument("--num-blocks", type=int, default=256, help="the engine's KV pool")
    parser.add_argument("--calibrate", type=float, default=6.0, help="seconds of each round's capacity measurement")
    parser.add_argument("--capacity", type=float, help="generated tokens/s to offer the load against, not measured")
    parser.add_argument("--capacity-concurrency", type=lambda text: [int(n) for n in text.split(",")],
                        default=[32, 64], help="requests in flight when measuring the capacity (its best counts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave the engine, the guard and the load generator unpinned (see layout)")
    parser.add_argument("--quick", action="store_true", help="one short round: checks that it runs")
    parser.add_argument("--json", type=Path, help="the report (default bench/results/batch.json; --quick: none)")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.rounds, args.drain, args.settle, args.calibrate, args.batch_lines = 3, 1, 3, 1, 1, 300
    started_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as workdir:
        outcome = asyncio.run(run(args, Path(workdir)))
    report = {"benchmark": "batch", "machine": describe(torch.device("cpu")), "command": command(),
              "load_average_1m_at_start": started_load, "settings": {k: v for k, v in vars(args).items()
                                                                       if k not in ("json",)}, **outcome}
    print(f"machine: {report['machine']}; load average at start {started_load:.2f}")
    s = outcome["summary"]
    print(f"interactive TTFT p50 beside a batch / alone: {s['ttft_p50_beside_over_alone']:.2f}x (target <= 1.2x); "
          f"the batch's share of the capacity interactive work leaves: {s['batch_share_of_left']:.0%} (target >= 80%); "
          f"of that capacity measured side by side: {s['batch_share_of_left_measured']:.0%}")
    if args.json is not None or not args.quick:
        write_report(args.json or REPO / "bench" / "results" / "batch.json", report)


if __name__ == "__main__":
    main()
