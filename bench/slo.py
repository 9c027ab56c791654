"""SLO-aware admission under 2x overload: attainment per lane and goodput, three ways side by side.

One engine (``python -m engine --model tiny --num-blocks N``) serves, in one run, taking turns block by block
(each round starts one later: a shared machine's drift weighs on all alike):

  (a) kvguard with SLOs      lanes interactive {slo: {ttft_ms: 1500}, priority_class: critical} and batch
                             {slo: {ttft_ms: --batch-ttft-ms}, priority_class: sheddable}
  (b) kvguard without SLOs   the same tenants and lanes, without slo or priority_class (the defaults)
  (c) FIFO                   straight to the engine, no priority (nobody sets one without the guard)

Two tenants of equal weight arrive open-loop (bench/tenant_load.py) with the same seeded arrival times for
every configuration: ``web`` sends short streamed chats in the interactive lane, ``batch`` long streamed
generations in the batch lane. Their rates are set from the engine's capacity, measured at the start of
every round (a saturating batch-only load straight to the engine, generated tokens per second; on a shared
machine it moved by 2x within minutes, and one measurement at the start let a run's "2x" be ~1x by its
end): ``web`` offers ``--web-share`` of it and ``batch`` the rest of ``--load`` (2x by default), in
generated tokens; within a round the three configurations get the same rates and arrival times.

A request *meets its objective* when its first token arrives within its lane's TTFT objective of its
scheduled arrival (1.5 s interactive, ``--batch-ttft-ms`` batch; the same objectives judge (b) and (c),
which do not know them). Goodput is the requests that met their objective per second of arrivals. When a
block's arrivals end, its requests get ``--drain`` seconds; what is left then is cancelled and counts as
missed. Also reported: how fast refusals were answered (p95), the engine's preemptions per tenant, the
engine's KV pool in use and its running sequences while arrivals ran (sampled every 0.25 s), the tokens
it generated per second from a block's start until it was idle again (against the capacity), the ceiling
of goodput over (b) (every request offered meets its objective: what no configuration can pass), and for
(a) the TTFT the guard predicted against the TTFT it saw (its decision log: median absolute relative error).

    .venv/bin/python bench/slo.py [--duration 40] [--rounds 2] [--drain 8] [--json PATH]   # ~4.5 min
    .venv/bin/python bench/slo.py --quick      # one round of 1.5-second blocks: checks that it runs
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
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
import torch
from latency import percentile, summarize
from run_info import command, describe, write_report
from stack import REPO, Service, get_json, start_engine, start_guard
from tenant_load import Result, Target, arrivals, engine_target, guard_target, send, status_counts

KEYS = {"web": "sk-bench-web", "batch": "sk-bench-batch"}
LANES = {"web": "interactive", "batch": "batch"}
SERIAL = itertools.count()  # distinct prompts from the first byte: no request hits another's prefix cache
WEB_PROMPT = "{index:07d} where is my order? " * 2
BATCH_PROMPT = "{index:07d} summarize this quarterly report section by section. " * 4
WEB_TTFT_S = 1.5


@dataclass(frozen=True, slots=True)
class Load:
    web_rate: float
    batch_rate: float
    web_max_tokens: int
    batch_max_tokens: int
    block: float
    drain: float
    batch_ttft_s: float

    def body(self, tenant: str) -> dict:
        web = tenant == "web"
        prompt = (WEB_PROMPT if web else BATCH_PROMPT).format(index=next(SERIAL))
        return {"model": "tiny", "prompt": prompt, "max_tokens": self.web_max_tokens if web else
                self.batch_max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}

    def objective(self, tenant: str) -> float:
        return WEB_TTFT_S if tenant == "web" else self.batch_ttft_s


@dataclass(slots=True)
class Tally:
    results: dict[str, list[Result]] = field(default_factory=lambda: {"web": [], "batch": []})
    preemptions: Counter = field(default_factory=Counter)  # by tenant
    load_averages: list[float] = field(default_factory=list)
    # Engine telemetry sampled while arrivals run: (share of the KV pool in use, sequences running).
    occupancy: list[tuple[float, int]] = field(default_factory=list)
    generated: int = 0  # tokens the engine generated from the block's start to its idle end (drain included)
    # Per block, in the order run: each lane's attainment and the load average after it (a stall of the shared
    # machine shows as one bad block; a fault of the configuration, as all of them).
    blocks: list[dict] = field(default_factory=list)
    busy_s: float = 0.0  # over this many seconds


def telemetry(engine: Service) -> dict:
    return get_json(engine.url + "/telemetry")


async def wait_idle(engine: Service, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        snap = await asyncio.to_thread(telemetry, engine)
        if snap["num_running"] + snap["num_waiting"] + snap["num_swapped"] == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine is still busy {timeout:g} s after the block")
        await asyncio.sleep(0.1)


async def measure_capacity(engine: Service, load: Load, seconds: float) -> float:
    """Generated tokens per second with the engine saturated by batch requests (64 in flight), over
    ``seconds``; what is still running then is cancelled."""
    target = engine_target(engine.url, list(KEYS))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker() -> None:
            while True:
                await send(session, target, "batch", load.body("batch"), Result(arrival=time.monotonic()))
        workers = [asyncio.create_task(worker()) for _ in range(64)]
        await asyncio.sleep(min(2.0, seconds / 2))  # the engine fills up first
        before = await asyncio.to_thread(telemetry, engine)
        started = time.monotonic()
        await asyncio.sleep(seconds)
        after = await asyncio.to_thread(telemetry, engine)
        elapsed = time.monotonic() - started
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    await wait_idle(engine)
    return (after["generation_tokens_total"] - before["generation_tokens_total"]) / elapsed


async def sample_occupancy(engine: Service, until: float, into: list[tuple[float, int]]) -> None:
    """Every 0.25 s until ``until``: the share of the engine's KV pool in use and its running sequences
    (what tells a guard that leaves the pool idle from one that fills it)."""
    while time.monotonic() < until:
        try:
            snap = await asyncio.to_thread(telemetry, engine)
        except OSError:  # (a timeout: on a busy shared machine an answer took over 2 s; the sample is skipped)
            continue
        used = snap["num_blocks"] - snap["free_blocks"] - snap["cached_blocks"]
        into.append((used / snap["num_blocks"], snap["num_running"]))
        await asyncio.sleep(0.25)


async def block(target: Target, load: Load, seed: int, engine: Service, tally: Tally) -> None:
    """Offer both tenants' load to ``target`` for ``load.block`` seconds; tally what came of it."""
    before = await asyncio.to_thread(telemetry, engine)
    began = time.monotonic()
    results: dict[str, list[Result]] = {"web": [], "batch": []}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.monotonic() + 0.1
        schedules = [arrivals(rate, seed + i, start, load.block,
                              lambda r, t=tenant: send(session, target, t, load.body(t), r), results[tenant])
                     for i, (tenant, rate) in enumerate((("web", load.web_rate), ("batch", load.batch_rate)))]
        sampler = asyncio.create_task(sample_occupancy(engine, start + load.block, tally.occupancy))
        tasks = [task for tasks in await asyncio.gather(*schedules) for task in tasks]
        await sampler
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, start + load.block + load.drain - time.monotonic()))
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    await wait_idle(engine)
    after = await asyncio.to_thread(telemetry, engine)
    tally.generated += after["generation_tokens_total"] - before["generation_tokens_total"]
    tally.busy_s += time.monotonic() - began
    for tenant in KEYS:
        tally.results[tenant] += results[tenant]
        was = before["tenants"].get(tenant, {}).get("preemptions_total", 0)
        tally.preemptions[tenant] += after["tenants"].get(tenant, {}).get("preemptions_total", 0) - was
    tally.load_averages.append(os.getloadavg()[0])
    tally.blocks.append({"load_average_1m": tally.load_averages[-1],
                         **{LANES[tenant]: sum(met(r, load.objective(tenant)) for r in rs) / len(rs) if rs else None
                            for tenant, rs in results.items()}})


def met(result: Result, objective_s: float) -> bool:
    """Answered in full, its first token within ``objective_s`` of its scheduled arrival."""
    return result.status == 200 and result.finished is not None and result.first_token is not None and \
        result.first_token - result.arrival <= objective_s


def summarize_config(label: str, tally: Tally, load: Load, seconds: float) -> dict:
    lanes = {}
    for tenant, results in tally.results.items():
        good = sum(met(r, load.objective(tenant)) for r in results)
        lanes[LANES[tenant]] = {
            "sent": len(results), "met": good, "attainment": good / len(results) if results else None,
            "goodput_per_s": good / seconds, "statuses": status_counts(results),
            "ttft": summarize([r.first_token - r.arrival for r in results if r.first_token is not None]),
            "engine_preemptions": tally.preemptions[tenant]}
    refusals = sorted(r.finished - r.arrival for rs in tally.results.values() for r in rs
                      if r.finished is not None and r.status not in (200, 0, None))
    return {"label": label, "lanes": lanes, "goodput_per_s": sum(lane["goodput_per_s"] for lane in lanes.values()),
            "offered_per_s": sum(lane["sent"] for lane in lanes.values()) / seconds,
            "refusals": len(refusals), "refusals_within_200ms": sum(seconds <= 0.2 for seconds in refusals),
            "refusal_p50_ms": 1e3 * percentile(refusals, 50) if refusals else None,
            "refusal_p95_ms": 1e3 * percentile(refusals, 95) if refusals else None,
            "load_average_1m": statistics.mean(tally.load_averages),
            "engine_kv_used_mean": statistics.mean(u for u, _ in tally.occupancy) if tally.occupancy else None,
            "engine_running_mean": statistics.mean(r for _, r in tally.occupancy) if tally.occupancy else None,
            "engine_tokens_per_s": tally.generated / tally.busy_s if tally.busy_s else None,
            "blocks": tally.blocks}


def prediction_error(log: Path) -> dict:
    """|predicted - actual| / actual TTFT over the SLO guard's streams that got a first token: median and
    p90, over all and per lane; and what the error is made of, per lane: the median of predicted / actual
    (its bias), and the median absolute errors of its two parts, arrival to admission (the guard's queue)
    and admission to the first token (the engine), each over the actual TTFT."""
    rows: dict[str, list[tuple[float, float, float, float]]] = {"all": []}
    for line in log.read_text().splitlines() if log.exists() else []:
        record = json.loads(line)
        slo, actual, queue = record.get("slo") or {}, record.get("ttft_ms"), record.get("queue_ms")
        if actual and queue is not None and slo.get("predicted_ttft_ms") is not None:
            predicted_queue = slo.get("predicted_queue_ms") or 0.0
            predicted_engine = slo.get("predicted_engine_ms") or 0.0
            row = (abs(slo["predicted_ttft_ms"] - actual) / actual, slo["predicted_ttft_ms"] / actual,
                   abs(predicted_queue - queue) / actual, abs(predicted_engine - (actual - queue)) / actual)
            rows["all"].append(row)
            rows.setdefault(record["lane"], []).append(row)

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    return {lane: {"n": len(values), "median_abs_rel_error": median([v[0] for v in values]),
                   "p90_abs_rel_error": percentile(sorted(v[0] for v in values), 90) if values else None,
                   "median_predicted_over_actual": median([v[1] for v in values]),
                   "median_queue_abs_error_over_actual": median([v[2] for v in values]),
                   "median_engine_abs_error_over_actual": median([v[3] for v in values])}
            for lane, values in rows.items()}


def guard_config(engine_url: str, batch_ttft_ms: float | None, log: Path | None) -> dict:
    """Both tenants of weight 1; with ``batch_ttft_ms``, the lanes' objectives and classes."""
    lanes = {"interactive": {"priority": 1, "timeout": 10.0}, "batch": {"priority": 4, "timeout": 300.0}}
    if batch_ttft_ms is not None:
        lanes["interactive"] |= {"slo": {"ttft_ms": 1e3 * WEB_TTFT_S}, "priority_class": "critical"}
        lanes["batch"] |= {"slo": {"ttft_ms": batch_ttft_ms}, "priority_class": "sheddable"}
    config = {"engine": {"name": "primary", "url": engine_url}, "secret": "bench-slo", "lanes": lanes,
              "tenants": [{"name": tenant, "api_keys": [key], "weight": 1, "lane": LANES[tenant], "max_queue": 256}
                          for tenant, key in KEYS.items()]}
    if log is not None:
        config["decision_log"] = str(log)
    return config


async def run(args: argparse.Namespace, workdir: Path) -> dict:
    engine = start_engine(workdir, args.engine_flags)
    guards: list[Service] = []
    try:
        load = Load(0, 0, args.web_max_tokens, args.batch_max_tokens, args.duration / args.rounds, args.drain,
                    args.batch_ttft_ms / 1e3)
        capacities: list[float] = []
        log = workdir / "decisions.jsonl"
        for name, batch_ttft_ms in (("guard-slo", args.batch_ttft_ms), ("guard", None)):  # (a), (b)
            config = guard_config(engine.url, batch_ttft_ms, log if batch_ttft_ms is not None else None)
            guards.append(start_guard(workdir, config, name=name))
        configs = [("(a) kvguard with SLOs", guard_target(guards[0].url, KEYS)),
                   ("(b) kvguard without SLOs", guard_target(guards[1].url, KEYS)),
                   ("(c) FIFO straight to the engine", engine_target(engine.url, list(KEYS)))]
        configs = [config for config, letter in zip(configs, "abc") if letter in args.configs]
        tallies = [Tally() for _ in configs]
        for round_index in range(args.rounds):
            capacities.append(args.capacity or await measure_capacity(engine, load, args.calibrate))
            load = replace(load, web_rate=args.web_share * capacities[-1] / args.web_max_tokens,
                           batch_rate=(args.load - args.web_share) * capacities[-1] / args.batch_max_tokens)
            print(f"  round {round_index + 1}/{args.rounds}: capacity {capacities[-1]:.0f} tokens/s", flush=True)
            turn = round_index % len(configs)
            for (label, target), tally in [*zip(configs, tallies)][turn:] + [*zip(configs, tallies)][:turn]:
                await block(target, load, args.seed + 2 * round_index, engine, tally)
                print(f"  round {round_index + 1}/{args.rounds} {label}: done", flush=True)
    finally:
        for service in (*guards, engine):
            service.stop()
    phases = [summarize_config(label, tally, load, args.duration) for (label, _), tally in zip(configs, tallies)]
    capacity = statistics.mean(capacities)
    return {"capacity_tokens_per_s": capacity, "capacity_per_round": capacities,
            "web_rate_per_s": args.web_share * capacity / args.web_max_tokens,
            "batch_rate_per_s": (args.load - args.web_share) * capacity / args.batch_max_tokens, "phases": phases, "prediction": prediction_error(log)}


def table(phases: list[dict]) -> str:
    head = (f"{'configuration':32} {'lane':12} {'sent':>5} {'met':>5} {'attain':>7} {'goodput/s':>9} "
            f"{'TTFT p50':>9} {'p99':>8} {'preempt':>7}  statuses")
    rows = [head, "-" * len(head)]
    for p in phases:
        for lane, s in p["lanes"].items():
            ttft = s["ttft"]
            rows.append(f"{p['label']:32} {lane:12} {s['sent']:>5} {s['met']:>5} {_pct(s['attainment']):>7} "
                        f"{s['goodput_per_s']:>9.2f} {_ms(ttft['p50_ms']):>9} {_ms(ttft['p99_ms']):>8} "
                        f"{s['engine_preemptions']:>7}  {s['statuses']}")
        rows.append(f"{p['label']:32} {'total':12} {'':>5} {'':>5} {'':>7} {p['goodput_per_s']:>9.2f}  refusals "
                    f"{p['refusals']} ({p['refusals_within_200ms']} within 200 ms), p50 {_ms(p['refusal_p50_ms'])} ms,"
                    f" p95 {_ms(p['refusal_p95_ms'])} ms;"
                    f" engine KV used {_pct(p['engine_kv_used_mean'])}, running {_ratio(p['engine_running_mean'])},"
                    f" {p['engine_tokens_per_s']:.0f} tokens/s;"
                    f" load {p['load_average_1m']:.1f}")
        per_block = ", ".join(f"{_pct(b['interactive'])} / {_pct(b['batch'])} (load {b['load_average_1m']:.1f})"
                              for b in p["blocks"])
        rows.append(f"{p['label']:32} {'blocks':12} attainment interactive / batch, block by block: {per_block}")
    return "\n".join(rows)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per configuration")
    parser.add_argument("--rounds", type=int, default=2, help="blocks per configuration, interleaved")
    parser.add_argument("--drain", type=float, default=8.0, help="seconds a block's requests get after it")
    parser.add_argument("--load", type=float, default=2.0, help="offered generated tokens over the capacity")
    parser.add_argument("--web-share", type=float, default=0.5, help="of the capacity, offered by web")
    parser.add_argument("--web-max-tokens", type=int, default=32)
    parser.add_argument("--batch-max-tokens", type=int, default=256)
    parser.add_argument("--batch-ttft-ms", type=float, default=10000.0, help="the batch lane's TTFT objective")
    parser.add_argument("--num-blocks", type=int, default=256, help="the engine's KV pool")
    parser.add_argument("--calibrate", type=float, default=6.0, help="seconds of each round's capacity measurement")
    parser.add_argument("--capacity", type=float, help="generated tokens/s to offer the load against, not measured "
                        "(the same offered load for two trees, e.g. one with a change and one without)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="one round of 1.5-second blocks: checks that it runs")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "slo.json")
    parser.add_argument("--decision-log", type=Path, help="keep (a)'s decision log here (JSON lines)")
    parser.add_argument("--configs", default="abc", help="which configurations to run (letters; default all)")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.rounds, args.drain, args.calibrate = 1.5, 1, 1.0, 0.6
    args.engine_flags = ["--model", "tiny", "--device", "cpu", "--num-blocks", str(args.num_blocks)]
    started_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-slo-") as workdir:
        outcome = asyncio.run(run(args, Path(workdir)))
        if args.decision_log is not None and (Path(workdir) / "decisions.jsonl").exists():
            shutil.copy(Path(workdir) / "decisions.jsonl", args.decision_log)
    phases = {phase["label"][:3]: phase for phase in outcome["phases"]}
    base = phases["(b)"]["goodput_per_s"] if "(a)" in phases and "(b)" in phases else None
    report = {"benchmark": "slo", "machine": describe(torch.device("cpu")), "command": command(),
              "load_average_1m_at_start": started_load, "engine_flags": args.engine_flags,
              "load": {"offered_over_capacity": args.load, "web_share": args.web_share,
                       "web_max_tokens": args.web_max_tokens, "batch_max_tokens": args.batch_max_tokens,
                       "web_ttft_ms": 1e3 * WEB_TTFT_S, "batch_ttft_ms": args.batch_ttft_ms,
                       "duration_s": args.duration, "rounds": args.rounds, "drain_s": args.drain, "seed": args.seed},
              **outcome,
              "goodput_over_without_slo": phases["(a)"]["goodput_per_s"] / base if base else None,
              # The most any configuration could reach over (b): every request offered meets its objective.
              "ceiling_over_without_slo": phases["(a)"]["offered_per_s"] / base if base else None}
    print(f"machine: {report['machine']}; load average at start {started_load:.2f}")
    print(f"command: {report['command']}")
    if args.quick:
        print("QUICK RUN: blocks of a few seconds, not a measurement")
    rounds = " / ".join(f"{capacity:.0f}" for capacity in outcome["capacity_per_round"])
    print(f"engine capacity {outcome['capacity_tokens_per_s']:.0f} generated tokens/s (rounds: {rounds}); web "
          f"{outcome['web_rate_per_s']:.2f} req/s, batch {outcome['batch_rate_per_s']:.2f} req/s ({args.load:g}x), on average")
    print(table(outcome["phases"]))
    ratio = report["goodput_over_without_slo"]
    ceiling = report["ceiling_over_without_slo"]
    print(f"goodput with SLOs over without: {'-' if ratio is None else f'{ratio:.2f}x'} (the ceiling, every request "
          f"offered in time: {'-' if ceiling is None else f'{ceiling:.2f}x'})")
    for lane, prediction in outcome["prediction"].items():
        print(f"predicted vs actual TTFT (a), {lane}: median |error| {_pct(prediction['median_abs_rel_error'])}, "
              f"p90 {_pct(prediction['p90_abs_rel_error'])} over {prediction['n']} streams; median predicted/actual "
              f"{_ratio(prediction['median_predicted_over_actual'])}; median |error| of the queue part "
              f"{_pct(prediction['median_queue_abs_error_over_actual'])}, of the engine part "
              f"{_pct(prediction['median_engine_abs_error_over_actual'])} (of the actual TTFT)")
    write_report(args.json, report)
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
