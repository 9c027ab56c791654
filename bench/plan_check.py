"""Issue 18: the capacity planner's queueing prediction against a real engine behind the guard.

One tiny engine (CPU, ``--num-blocks 29`` of 16 tokens) behind one guard. Every request is the same size: a
random prompt (no prefix-cache hits) and ``ignore_eos`` with a ``max_tokens`` that fills exactly
``SEQUENCE_BLOCKS`` blocks, so each takes one stream slot of the planner's (a *server* of Erlang-C). The
planner reads the engine's pool (``--from-engine``) with margin ``1 - safe_utilization``: its slots are the
requests the guard's KV gate admits at once (0.85 x 29 = 24.65 blocks: 4 requests of 6 blocks). The guard's
hysteresis is switched off (``resume_utilization = safe_utilization``): closed, the gate would admit only up
to the lower resume envelope (3 slots here), which the planner does not model.

A calibration measures the capacity: completions per second with ``slots`` closed-loop clients (every slot
busy). Then, for each ``rho``, Poisson arrivals at ``rho x capacity`` for ``--requests`` requests (the
utilization reached is a little lower: under continuous batching a request runs faster when fewer share
the steps). Measured per rate: the mean queue wait and P(wait > 10 ms) (deltas of the guard's
``guard_queue_wait_seconds`` histogram: arrival to admission), the mean service time (the engine's
``engine_e2e_request_latency_seconds``: its arrival, the guard's admission, to the last token), the
service's coefficient of variation (of the streamed decode spans, first event to last), and the engine's
running requests sampled every 50 ms (mean, against the planner's offered load; max, against its slots).
Predicted: the planner's command line, fed the measured rate and mean service time, on that engine (``--from-engine``): servers, P(wait) and mean wait on one replica
(Erlang-C, M/M/c). Service times here are near-constant, not exponential, so M/M/c overstates the wait; the
Allen-Cunneen factor ``(1 + cv^2) / 2`` (Poisson arrivals) is printed beside it as the usual correction.

    .venv/bin/python bench/plan_check.py [--requests 400] [--rho 0.4 0.6 0.75 0.85 0.9] [--json PATH]
    .venv/bin/python bench/plan_check.py --quick     # one rate, 30 requests: checks that it runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import torch
import yaml
from run_info import command, describe, write_report
from soak import metric_samples
from stack import REPO, Service, get_json, start_engine, start_guard

from engine.model.tiny import tiny_config

NUM_BLOCKS, BLOCK_SIZE, SEQUENCE_BLOCKS = 29, 16, 6
SAFE_UTILIZATION = 0.85
PROMPT_CHARS = 24
KEY = "sk-bench-plan"
WAITED_S = "0.01"  # the queue-wait bucket under which a request counts as not having waited
SAMPLE_S = 0.05
WAIT_HISTOGRAM = "guard_queue_wait_seconds"
SERVICE_HISTOGRAM = "engine_e2e_request_latency_seconds"  # engine arrival (guard admission) to last token


def prompt(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_letters, k=PROMPT_CHARS))


def count_tokens(engine: Service, text: str) -> int:
    body = json.dumps({"model": "tiny", "prompt": text}).encode()
    ask = urllib.request.Request(engine.url + "/tokenize", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(ask, timeout=10) as answer:
        return json.load(answer)["count"]


async def send(session: aiohttp.ClientSession, url: str, text: str, max_tokens: int) -> tuple[float, float]:
    """One streamed completion through the guard: seconds to its first event and to its end (raises on
    anything but 200). Its decode span (end - first) stands for its service time's spread: the queue wait
    falls before the first event, and the prefill of a short prompt is one step."""
    started = time.monotonic()
    first = None
    body = {"model": "tiny", "prompt": text, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    async with session.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        if r.status != 200:
            raise RuntimeError(f"guard answered {r.status}: {(await r.read())[:200]!r}")
        async for _ in r.content:
            first = first or time.monotonic() - started
    return first or 0.0, time.monotonic() - started


def histogram_mean(url: str, name: str) -> tuple[float, float]:
    """(sum, count) of histogram ``name`` on ``url``/metrics, summed over its labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as page:
        text = page.read().decode()
    def total(series: str) -> float:  # labelled or not (the engine's histograms have no labels)
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith((series + " ", series + "{")))

    return total(name + "_sum"), total(name + "_count")


def wait_histogram(guard: Service) -> tuple[float, float, float]:
    """The guard's queue-wait histogram, summed over tenants: (sum, count, count at or under WAITED_S)."""
    with urllib.request.urlopen(guard.url + "/metrics", timeout=5) as page:
        text = page.read().decode()
    under = sum(v for labels, v in metric_samples(text, WAIT_HISTOGRAM + "_bucket").items()
                if f'le="{WAITED_S}"' in labels)
    return (sum(metric_samples(text, WAIT_HISTOGRAM + "_sum").values()),
            sum(metric_samples(text, WAIT_HISTOGRAM + "_count").values()), under)


async def sample_running(engine: Service, stop: asyncio.Event, samples: list[int]) -> None:
    while not stop.is_set():
        samples.append((await asyncio.to_thread(get_json, engine.url + "/telemetry"))["num_running"])
        await asyncio.sleep(SAMPLE_S)


async def poisson(guard: Service, engine: Service, rate: float, requests: int, max_tokens: int,
                  rng: random.Random) -> dict:
    """``requests`` Poisson arrivals at ``rate``/s; the measured queue and service figures."""
    before, engine_before = wait_histogram(guard), histogram_mean(engine.url, SERVICE_HISTOGRAM)
    stop, running = asyncio.Event(), []
    sampler = asyncio.create_task(sample_running(engine, stop, running))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = []
        started = time.monotonic()
        for _ in range(requests):
            tasks.append(asyncio.create_task(send(session, guard.url, prompt(rng), max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        offered_s = time.monotonic() - started
        answers = await asyncio.gather(*tasks)
    stop.set()
    await sampler
    after, engine_after = wait_histogram(guard), histogram_mean(engine.url, SERVICE_HISTOGRAM)
    waits, count, under = (a - b for a, b in zip(after, before, strict=True))
    service_sum, service_count = (a - b for a, b in zip(engine_after, engine_before, strict=True))
    spans = [end - first for first, end in answers]
    return {"rate_per_s": rate, "achieved_rate_per_s": requests / offered_s, "requests": requests,
            "mean_wait_s": waits / count, "p_wait": 1 - under / count, "mean_service_s": service_sum / service_count,
            "service_cv": statistics.pstdev(spans) / statistics.fmean(spans),
            "mean_running": statistics.fmean(running), "max_running": max(running)}


async def capacity(guard: Service, slots: int, seconds: float, max_tokens: int, rng: random.Random) -> float:
    """Completions per second with ``slots`` closed-loop clients: every slot busy, the most it can serve."""
    done = 0
    deadline = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            await send(session, guard.url, prompt(rng), max_tokens)
            done += 1

    started = time.monotonic()
    async with aiohttp.ClientSession() as session:
        await send(session, guard.url, prompt(rng), max_tokens)  # first steps are slow
        started = time.monotonic()
        await asyncio.gather(*(client(session) for _ in range(slots)))
    return done / (time.monotonic() - started)


def predict(workload: dict, workdir: Path, engine: Service) -> dict:
    """The planner's JSON plan for ``workload`` on ``engine``, through its command line."""
    path = workdir / "plan.yaml"
    path.write_text(yaml.safe_dump(workload))
    done = subprocess.run([sys.executable, "-m", "guard.plan", "--workload", str(path), "--json",
                           "--from-engine", engine.url], cwd=REPO, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the planner failed: {done.stderr}")
    return json.loads(done.stdout)


def compare(measured: dict, plan: dict) -> dict:
    row = plan["queueing"]["rows"][0]  # one replica: the engine under test
    cv2 = measured["service_cv"] ** 2
    mmc = row["mean_wait_s"]
    return {"servers": row["servers"], "utilization": row["utilization"], "p_wait": row["p_wait"],
            "mean_wait_s": mmc, "mean_wait_allen_cunneen_s": None if mmc is None else mmc * (1 + cv2) / 2,
            "mean_running": plan["queueing"]["offered_erlangs"],
            "p_wait_error": measured["p_wait"] - row["p_wait"],
            "mean_wait_error_s": None if mmc is None else measured["mean_wait_s"] - mmc}


async def run(args: argparse.Namespace, workdir: Path) -> dict:
    rng = random.Random(args.seed)
    engine = start_engine(workdir, ["--model", "tiny", "--device", "cpu", "--num-blocks", str(NUM_BLOCKS),
                                    "--block-size", str(BLOCK_SIZE)])
    guard = None
    try:
        guard = start_guard(workdir, {
            "engine": {"name": "primary", "url": engine.url}, "secret": "bench-plan-check",
            "admission": {"safe_utilization": SAFE_UTILIZATION, "resume_utilization": SAFE_UTILIZATION},
            "lanes": {"interactive": {"priority": 1, "timeout": 600.0}},
            "tenants": [{"name": "plan", "api_keys": [KEY], "lane": "interactive", "max_queue": 10_000}]})
        prompt_tokens = count_tokens(engine, prompt(rng))
        max_tokens = SEQUENCE_BLOCKS * BLOCK_SIZE - prompt_tokens
        tiny = tiny_config()
        workload = {"model": {"layers": tiny.num_hidden_layers, "kv_heads": tiny.num_key_value_heads,
                              "head_dim": tiny.head_dim, "kv_bytes": 4, "weight_bytes": 0},
                    "margin": round(1 - SAFE_UTILIZATION, 6), "streams": 1,
                    "mix": [{"name": "fixed", "share": 1.0, "p95_input": prompt_tokens, "p95_output": max_tokens}]}
        slots = predict(workload, workdir, engine)["slots_per_replica"]
        most = await capacity(guard, slots, args.calibration_s, max_tokens, rng)
        rates = []
        for rho in args.rho:
            measured = await poisson(guard, engine, rho * most, args.requests, max_tokens, rng)
            arrivals = {"rate_per_s": measured["achieved_rate_per_s"], "mean_service_s": measured["mean_service_s"],
                        "max_wait_s": 3600.0}
            plan = predict({**workload, "arrivals": arrivals}, workdir, engine)
            rates.append({"target_rho": rho, "measured": measured, "predicted": compare(measured, plan)})
            print(f"  rho {rho:g}: done", flush=True)
    finally:
        for service in (guard, engine):
            if service is not None:
                service.stop()
    return {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "slots": slots, "capacity_per_s": most,
            "rates": rates}


def print_report(report: dict) -> None:
    print(f"machine: {report['machine']}; load average at start {report['load_average_1m_at_start']:.2f}")
    print(f"command: {report['command']}")
    if report["quick"]:
        print("QUICK RUN: one rate, few requests, not a measurement")
    print(f"engine: tiny, {NUM_BLOCKS} blocks x {BLOCK_SIZE}; requests {report['prompt_tokens']} + "
          f"{report['max_tokens']} tokens ({SEQUENCE_BLOCKS} blocks); planner slots {report['slots']}; "
          f"capacity {report['capacity_per_s']:.2f} requests/s with every slot busy")
    head = (f"{'rho':>5} {'rate/s':>7} {'S ms':>6} {'cv':>5} {'running':>13} {'P(wait)':>15} "
            f"{'mean wait ms (meas / M/M/c / A-C)':>34}")
    print(head + "\n" + "-" * len(head))
    for r in report["rates"]:
        m, p = r["measured"], r["predicted"]
        mmc, ac = (_ms(p["mean_wait_s"]), _ms(p["mean_wait_allen_cunneen_s"]))
        print(f"{p['utilization']:>5.2f} {m['achieved_rate_per_s']:>7.2f} {m['mean_service_s'] * 1e3:>6.0f} "
              f"{m['service_cv']:>5.2f} {m['mean_running']:>5.2f}/{p['mean_running']:<4.2f}<={m['max_running']} "
              f"{m['p_wait']:>7.3f}/{p['p_wait']:<7.3f} {m['mean_wait_s'] * 1e3:>14.0f} / {mmc:>7} / {ac:>7}")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{seconds * 1e3:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400, help="Poisson arrivals per rate")
    parser.add_argument("--rho", type=float, nargs="+", default=[0.4, 0.6, 0.75, 0.85, 0.9],
                        help="arrival rates as shares of the measured capacity (every slot busy)")
    parser.add_argument("--calibration-s", type=float, default=15.0, help="seconds of the capacity run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="one rate, 30 requests: checks that it runs")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "plan_check.json")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.rho, args.calibration_s = 30, [0.5], 3.0
    started_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="plan-check-") as workdir:
        result = asyncio.run(run(args, Path(workdir)))
    report = {"benchmark": "plan_check", "quick": args.quick, "machine": describe(torch.device("cpu")),
              "command": command(), "load_average_1m_at_start": started_load, **result}
    print_report(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_report(args.json, report)
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
