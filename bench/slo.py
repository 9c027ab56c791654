"""SLO-aware admission against the strongest configuration without it (issue 43): scenarios, goodput, goals.

Each *cell* (a scenario at one load, bench/slo_scenarios.py) runs on its own engines: a calibration first
(every engine saturated at once by batch requests straight to it, ``--calibrate-s`` seconds, generated
tokens per second: the capacity C, fixed for the whole cell; ``--capacity`` gives it instead), then
``--rounds`` rounds in which every configuration gets one block of ``--block-s`` seconds of open-loop
arrivals (bench/tenant_load.py), each round starting one configuration later. Within a round every
configuration gets the same rates, prompts and arrival seeds; each guard writes a decision log.

    configurations  a (SLOs), a_nofilter (S3), b1 (without SLOs), b2 (b1, timeouts = objectives),
                    b3 (b1, interactive tenants weighted to half the pool), fifo (straight to the engine)
    scenarios       S1 (2 interactive + 6 batch tenants; L = 2, 4), S2 (web + batch; L = 2, 3),
                    S3 (S2's tenants on two engines, one about half the other; L = 2)

When a block's arrivals end, its requests get ``--drain`` seconds; what is left is cancelled and counts as
missed. Figures per block (bench/slo_measures.py): request and token goodput, attainment and late share per
lane, refusal latency per code, engine preemptions per lane, the guard's prediction error per lane and
replica; per round, the oracle (every interactive request on time plus B1's batch requests on time). Each
cell's report goes to ``--out-dir``/<cell>.json; then every cell report there is judged against the
issue's goals (bench/slo_goals.py) into ``goals.json``.

    .venv/bin/python bench/slo.py        # the issue's spec: 120 s blocks, 3 rounds, 5 cells: ~2.5 hours
    .venv/bin/python bench/slo.py --scenarios S1 --loads 2 --block-s 30 --rounds 3    # one cell, scaled down
    .venv/bin/python bench/slo.py --goals-only                 # judge the cell reports already in --out-dir
    .venv/bin/python bench/slo.py --quick   # S2 at L = 2, one round of 2-second blocks: checks that it runs
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import torch
from run_info import command, describe, write_report
from slo_goals import config_rows, evaluate, goal_lines, goal_rows, load_cells
from slo_measures import block_figures, in_window, prediction_error, read_records
from slo_scenarios import BATCH, INTERACTIVE, LABELS, PROMPTS, Scenario, guard_config, scenario
from stack import REPO, Service, get_json, start_engine, start_guard
from tenant_load import Result, Target, arrivals, engine_target, guard_target, send

SERIAL = itertools.count()  # distinct prompts from the first byte: no request hits another's prefix cache
DEFAULT_LOADS = {"S1": (2.0, 4.0), "S2": (2.0, 3.0), "S3": (2.0,)}


def body(lane: str, max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": PROMPTS[lane].format(index=next(SERIAL)), "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True}


def telemetry(engine: Service) -> dict:
    return get_json(engine.url + "/telemetry")


async def wait_idle(engines: list[Service], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    for engine in engines:
        while True:
            snap = await asyncio.to_thread(telemetry, engine)
            if snap["num_running"] + snap["num_waiting"] + snap["num_swapped"] == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{engine.name} is still busy {timeout:g} s after the block")
            await asyncio.sleep(0.1)


async def calibrate(engines: list[Service], seconds: float) -> list[float]:
    """Generated tokens per second of each engine, all saturated at once by batch requests (64 in flight
    each) over ``seconds``: together they share this machine's cores as they will under the load."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def worker(target: Target) -> None:
            while True:
                await send(session, target, "calibrate", body(BATCH, 256), Result(arrival=time.monotonic()))
        workers = [asyncio.create_task(worker(engine_target(engine.url, ["calibrate"])))
                   for engine in engines for _ in range(64)]
        await asyncio.sleep(min(3.0, seconds / 2))  # the engines fill up first
        before = [await asyncio.to_thread(telemetry, engine) for engine in engines]
        started = time.monotonic()
        await asyncio.sleep(seconds)
        after = [await asyncio.to_thread(telemetry, engine) for engine in engines]
        elapsed = time.monotonic() - started
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    await wait_idle(engines)
    return [(a["generation_tokens_total"] - b["generation_tokens_total"]) / elapsed for a, b in zip(after, before)]


async def sample_kv(engines: list[Service], until: float, into: list[float]) -> None:
    """Every 0.5 s until ``until``: the share of the engines' KV pools in use (a guard that leaves the pool
    idle shows here)."""
    while time.monotonic() < until:
        try:
            snaps = [await asyncio.to_thread(telemetry, engine) for engine in engines]
        except OSError:  # an answer that took over 2 s on a busy machine: the sample is skipped
            continue
        used = sum(s["num_blocks"] - s["free_blocks"] - s["cached_blocks"] for s in snaps)
        into.append(used / sum(s["num_blocks"] for s in snaps))
        await asyncio.sleep(0.5)


def preemptions(snaps: list[dict]) -> Counter:
    return Counter({name: usage.get("preemptions_total", 0) for snap in snaps
                    for name, usage in snap["tenants"].items()})


async def block(sc: Scenario, target: Target, rates: dict[str, float], seed: int, engines: list[Service],
                args: argparse.Namespace) -> tuple[dict[str, list[Result]], dict]:
    """Offer every tenant's load to ``target`` for ``args.block_s`` seconds, then its drain; the results and
    what the engines did meanwhile."""
    before = [await asyncio.to_thread(telemetry, engine) for engine in engines]
    began_wall, began = time.time(), time.monotonic()
    results: dict[str, list[Result]] = {t.name: [] for t in sc.tenants}
    kv: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.monotonic() + 0.1
        schedules = [arrivals(rates[t.name], seed + i, start, args.block_s,
                              lambda r, t=t: send(session, target, t.name, body(t.lane, t.max_tokens), r),
                              results[t.name], sc.interactive_on_off if t.lane == INTERACTIVE else None)
                     for i, t in enumerate(sc.tenants)]
        sampler = asyncio.create_task(sample_kv(engines, start + args.block_s, kv))
        tasks = [task for tasks in await asyncio.gather(*schedules) for task in tasks]
        await sampler
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, start + args.block_s + args.drain - time.monotonic()))
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    await wait_idle(engines)
    after = [await asyncio.to_thread(telemetry, engine) for engine in engines]
    generated = sum(a["generation_tokens_total"] - b["generation_tokens_total"] for a, b in zip(after, before))
    engine = {"preemptions": dict(preemptions(after) - preemptions(before)),
              "kv_used_mean": statistics.mean(kv) if kv else None,
              "engine_tokens_per_s": generated / (time.monotonic() - began),
              "window": [began_wall, time.time() + 5.0], "load_average_1m": os.getloadavg()[0]}
    return results, engine


async def run_cell(sc: Scenario, args: argparse.Namespace, configs: list[str], workdir: Path) -> dict:
    engines = [start_engine(workdir, list(flags), name=f"engine{i}", tree=args.tree) for i, flags in enumerate(sc.engines)]
    guards: dict[str, Service] = {}
    try:
        per_engine = [args.capacity / len(engines)] * len(engines) if args.capacity else \
            await calibrate(engines, args.calibrate_s)
        capacity = sum(per_engine)
        print(f"{sc.cell}: capacity {capacity:.0f} generated tokens/s "
              f"({' + '.join(f'{c:.0f}' for c in per_engine)})", flush=True)
        rates = {t.name: sc.rate(t, capacity) for t in sc.tenants}
        urls = [engine.url for engine in engines]
        for config in configs:
            if config != "fifo":
                cfg = guard_config(sc, config, urls, args.batch_ttft_ms / 1e3, workdir / f"{config}.jsonl")
                guards[config] = start_guard(workdir, cfg, name=f"guard-{config}", tree=args.tree)
        keys = {t.name: t.key for t in sc.tenants}
        targets = {config: engine_target(urls[0], list(keys)) if config == "fifo" else
                   guard_target(guards[config].url, keys) for config in configs}
        blocks: dict[str, list[dict]] = {config: [] for config in configs}
        for round_index in range(args.rounds):
            turn = round_index % len(configs)
            for config in configs[turn:] + configs[:turn]:
                seed = args.seed + 1000 * round_index  # the same for every configuration of the round
                results, engine = await block(sc, targets[config], rates, seed, engines, args)
                figures = block_figures(sc, results, args.block_s, args.batch_ttft_ms / 1e3, engine["preemptions"])
                blocks[config].append({"round": round_index, **figures, **engine})
                print(f"  round {round_index + 1}/{args.rounds} {LABELS[config]}: goodput "
                      f"{figures['goodput_per_s']:.2f}/s, interactive "
                      f"{_pct(figures['lanes'][INTERACTIVE]['attainment'])}, batch "
                      f"{_pct(figures['lanes'][BATCH]['attainment'])} (load {engine['load_average_1m']:.1f})",
                      flush=True)
    finally:
        for service in (*guards.values(), *engines):
            service.stop()
    out = {}
    for config in configs:
        records = read_records(workdir / f"{config}.jsonl") if config in guards else []  # stopped: all written
        if args.keep_logs is not None and config in guards:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            for log in workdir.glob(f"{config}.jsonl*"):
                shutil.copy(log, args.keep_logs / f"{sc.cell}_{log.name}")
        for b in blocks[config]:
            b["prediction"] = prediction_error(in_window(records, *b["window"]))
        out[config] = {"label": LABELS[config], "blocks": blocks[config], "decision_records": len(records),
                       "prediction": prediction_error([r for b in blocks[config] for r in in_window(records, *b["window"])])}
    return {"cell": sc.cell, "scenario": sc.name, "load_over_capacity": sc.load,
            "interactive_share": sc.interactive_share, "interactive_on_off": sc.interactive_on_off,
            "tenants": [[t.name, t.lane, t.max_tokens] for t in sc.tenants],
            "engine_flags": [list(flags) for flags in sc.engines], "capacity_tokens_per_s": capacity,
            "capacity_per_engine": per_engine, "rates_per_s": rates, "configs": out,
            "oracle_goodput_per_s": oracle(out, args.block_s)}


def oracle(blocks: dict[str, dict], seconds: float) -> list[float] | None:
    """Per round: every interactive request on time plus B1's batch requests on time, per second."""
    if "b1" not in blocks:
        return None
    return [b["lanes"][INTERACTIVE]["sent"] / seconds + b["lanes"][BATCH]["goodput_per_s"]
            for b in blocks["b1"]["blocks"]]


def tree_commit(tree: Path) -> str | None:
    """The commit ``tree`` was exported from (its ``COMMIT`` file) or is checked out at, ``+dirty`` when its
    tracked files differ from it."""
    if (tree / "COMMIT").exists():
        return (tree / "COMMIT").read_text().strip()
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "guard", "engine"], check=False,
                               cwd=tree).returncode
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def on_off(text: str) -> tuple[float, float]:
    """``--interactive-on-off``'s ``ON,OFF``: two positive numbers of seconds."""
    try:
        on, off = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not ON,OFF (two numbers of seconds)") from None
    if on <= 0 or off < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: ON must be positive and OFF not negative")
    return on, off


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="S1,S2,S3", help="comma-separated: S1, S2, S3")
    parser.add_argument("--loads", help="comma-separated loads for every scenario run (default: S1 2,4; S2 2,3; S3 2)")
    parser.add_argument("--configs", help="comma-separated configurations (default: each scenario's own)")
    parser.add_argument("--block-s", type=float, default=120.0, help="seconds of arrivals per block")
    parser.add_argument("--rounds", type=int, default=3, help="blocks per configuration, interleaved")
    parser.add_argument("--drain", type=float, default=15.0, help="seconds a block's requests get after it")
    parser.add_argument("--interactive-share", type=float, default=0.5, help="of C, offered by interactive tenants")
    parser.add_argument("--interactive-on-off", type=on_off, help="ON,OFF seconds: the interactive lane offers its "
                        "load in bursts of ON seconds OFF seconds apart (the same mean rate)")
    parser.add_argument("--batch-ttft-ms", type=float, default=10000.0, help="the batch lane's TTFT objective")
    parser.add_argument("--num-blocks", type=int, default=256, help="each engine's KV pool")
    parser.add_argument("--calibrate-s", type=float, default=10.0, help="seconds of the capacity measurement")
    parser.add_argument("--capacity", type=float, help="generated tokens/s (all engines), not measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results" / "slo_issue43")
    parser.add_argument("--goals-only", action="store_true", help="judge the cell reports in --out-dir, run nothing")
    parser.add_argument("--tree", type=Path, default=REPO, help="the checkout whose guard and engines run (e.g. a clean "
                        "export of a commit: a shared working tree holds others' unfinished changes)")
    parser.add_argument("--keep-logs", type=Path, help="copy every guard's decision log here (<cell>_<config>.jsonl)")
    parser.add_argument("--markdown", action="store_true", help="also print every cell and the goals as Markdown")
    parser.add_argument("--quick", action="store_true", help="S2 at L = 2, one round of 2-second blocks")
    args = parser.parse_args()
    if args.quick:
        args.scenarios, args.loads, args.block_s, args.rounds, args.drain, args.calibrate_s = "S2", "2", 2.0, 1, 2.0, 1.0
    return args


def main() -> None:
    args = parse()
    machine = describe(torch.device("cpu"))
    print(f"machine: {machine}; load average at start {os.getloadavg()[0]:.2f}")
    print(f"command: {command()}")
    if args.quick:
        print("QUICK RUN: blocks of a few seconds, not a measurement")
    for name in ([] if args.goals_only else args.scenarios.split(",")):
        loads = [float(x) for x in args.loads.split(",")] if args.loads else DEFAULT_LOADS[name]
        for load in loads:
            sc = dataclasses.replace(scenario(name, load, args.interactive_share, args.num_blocks),
                                     interactive_on_off=args.interactive_on_off)
            configs = args.configs.split(",") if args.configs else list(sc.configs)
            if len(sc.engines) > 1:
                configs = [c for c in configs if c != "fifo"]  # FIFO has no balancer in front of two engines
            with tempfile.TemporaryDirectory(prefix="bench-slo-") as workdir:
                report = asyncio.run(run_cell(sc, args, configs, Path(workdir)))
            report |= {"benchmark": "slo", "machine": machine, "command": command(), "quick": args.quick,
                       "block_s": args.block_s, "rounds": args.rounds, "drain_s": args.drain, "seed": args.seed,
                       "batch_ttft_ms": args.batch_ttft_ms, "interactive_ttft_ms": 1500.0,
                       "guard_tree": str(args.tree), "guard_commit": tree_commit(args.tree)}
            write_report(args.out_dir / f"{sc.cell}.json", report)
            print(f"json: {args.out_dir / f'{sc.cell}.json'}", flush=True)
    goals = evaluate(load_cells(args.out_dir))
    write_report(args.out_dir / "goals.json", {"benchmark": "slo_goals", "machine": machine, "goals": goals})
    print("\n".join(goal_lines(goals)))
    if args.markdown:
        for name, cell in load_cells(args.out_dir).items():
            print(f"\n{name}: C {cell['capacity_tokens_per_s']:.0f} tokens/s, blocks {cell['block_s']:g} s x "
                  f"{cell['rounds']}, oracle {', '.join(f'{o:.2f}' for o in cell['oracle_goodput_per_s'] or [])}/s\n")
            print("\n".join(config_rows(cell)))
        print("\n" + "\n".join(goal_rows(goals)))


if __name__ == "__main__":
    main()
