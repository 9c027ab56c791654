"""Fill-and-Squeeze (reference 001, issue 8) against our engine: straight, then through the guard.

One engine process (``python -m engine --model tiny --num-blocks 96``: a small pool, so the tiny CPU model
reaches its memory edge) serves two runs, one after the other; a guard process stands in front of it for
the second only. Each run has two phases over time:

    baseline   the victims alone: their no-attack TTFT, measured in the same run
    attack     the victims go on; the attacker probes, fills and squeezes (bench/attacks/attacker.py)

  (1) unguarded: every tenant straight to the engine, named by ``X-Tenant-Id``
  (2) guarded:   every tenant through the guard with its own API key, all in the interactive lane; the
                 victims with weight ``--victim-weight``, each attacker key with ``--attacker-weight``;
                 the guard's default config otherwise: no ``max_blocks_share`` unless ``--block-share``
                 sets one (the same for every tenant: an operator's policy, not a rule aimed at the attacker)

``--keys 2`` is the colluding variant: one attacker behind two API keys (tenants ``attacker-1`` and
``attacker-2``), each move spread over both; ``--probe-jitter`` makes its probes irregular.

The victims (bench/attacks/victims.py) send the same seeded Poisson arrivals in both runs. While a run goes
on, the engine's ``/telemetry`` and the guard's ``/metrics`` are read every 0.25 s (timeline.py). The report
(report.py, plots.py) gives the victims' TTFT mean and p99 in the attack phase over the baseline phase (and,
for the guarded run, over the same phase of a third run through the guard with no attacker: the control), the
engine preemptions in each phase (``preemptions_total`` deltas; the attack's include the drain), the time
from the attacker's first long request to the first scrape showing
``guard_fill_squeeze_state{tenant="attacker"} 2``, and plots of victim TTFT, engine free blocks and the
attacker's detector state over time, checked against issues 8 and 16's targets: unguarded, mean TTFT >= 5x
baseline and preemptions climb; guarded, p99 TTFT <= 2x baseline (goal 1.5x), preemptions <= 10% of the
unguarded run's, every attacker key ``confirmed`` within 10 s of the fill starting, no victim ever flagged.

    .venv/bin/python -m bench.attacks.fill_squeeze [--out bench/results/fill_squeeze] [--attack 40] ...
    .venv/bin/python -m bench.attacks.fill_squeeze --keys 2 --probe-jitter 0.5 --out bench/results/fill_squeeze_2keys
    .venv/bin/python -m bench.attacks.fill_squeeze --quick     # a few seconds per phase: checks that it runs
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import shlex
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import aiohttp
import torch

from bench.attacks import report as figures
from bench.attacks.attacker import KINDS, AttackPlan, AttackRecord, attack
from bench.attacks.client import Outcome, Target, engine_target, guard_target, stream_completion
from bench.attacks.plots import write_plots
from bench.attacks.timeline import Sample, sample_until, table, telemetry
from bench.attacks.victims import VictimLoad, VictimRequest, victim_traffic
from bench.run_info import describe, write_report
from bench.stack import REPO, Service, start_engine, start_guard

VICTIMS = ("victim-1", "victim-2")
DEFAULT_PLAN = AttackPlan()


def attackers(args: argparse.Namespace) -> list[str]:
    """The attacker's tenants: ``attacker``, or ``attacker-1``..``attacker-N`` for N colluding keys."""
    return ["attacker"] if args.keys == 1 else [f"attacker-{i}" for i in range(1, args.keys + 1)]


def api_keys(args: argparse.Namespace) -> dict[str, str]:
    return {name: f"sk-bench-{name}" for name in (*VICTIMS, *attackers(args))}


def guard_config(engine_url: str, args: argparse.Namespace) -> dict:
    keys = api_keys(args)
    tenants = [{"name": name, "api_keys": [keys[name]], "lane": "interactive",
                "weight": args.victim_weight if name in VICTIMS else args.attacker_weight} for name in keys]
    if args.block_share is not None:
        for tenant in tenants:
            tenant["max_blocks_share"] = args.block_share
    return {"engine": {"name": "primary", "url": engine_url}, "admission": {"safe_utilization": 0.85},
            "secret": "bench-fill-squeeze", "tenants": tenants}


def attack_plan(args: argparse.Namespace) -> AttackPlan:
    return AttackPlan(probe_interval_s=args.probe_interval, long_max_tokens=args.long_max_tokens,
                      max_longs=args.max_longs, micro_rate=args.micro_rate,
                      micro_max_tokens=args.micro_max_tokens, probe_jitter=args.probe_jitter)


async def wait_idle(session: aiohttp.ClientSession, engine_url: str, timeout: float = 60.0) -> dict:
    """The first snapshot with nothing left in the engine and every block free (the next run starts clean)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = await telemetry(session, engine_url)
        if snap["num_running"] + snap["num_waiting"] + snap["num_swapped"] == 0 and \
                snap["free_blocks"] + snap["cached_blocks"] == snap["num_blocks"]:
            return snap
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine is still busy {timeout:g} s after the run: {snap}")
        await asyncio.sleep(0.1)


async def run_scenario(target: Target, engine_url: str, guard_url: str | None, args: argparse.Namespace,
                       attacker_process: ProcessPoolExecutor | None) -> dict:
    """Baseline, then attack, against ``target``; the run's record, its times in seconds since it began.
    Without ``attacker_process``, the control: the same victims and phases, and no attacker."""
    samples: list[Sample] = []
    victims: list[VictimRequest] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_until(stop, engine_url, guard_url, attackers(args), samples))
    # No connection cap on the clients' side: it would be a queue of its own, in front of the one under test.
    async with aiohttp.ClientSession() as control, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as victim_session:
        origin = time.monotonic() + 0.1
        attack_start, end = origin + args.baseline, origin + args.baseline + args.attack
        at_origin = await telemetry(control, engine_url)
        load = VictimLoad(VICTIMS, args.victim_rate, args.victim_max_tokens)
        schedule = asyncio.create_task(
            victim_traffic(victim_session, target, load, args.seed, origin, end, victims))
        await asyncio.sleep(max(0.0, attack_start - time.monotonic()))
        at_attack = await telemetry(control, engine_url)
        if attacker_process is None:
            attacker = AttackRecord([], None, None, None)
            await asyncio.sleep(max(0.0, end - time.monotonic()))
        else:  # in its own process (bench/attacks/attacker.py, attack); it hangs up on its requests at the end
            attacker = await asyncio.get_running_loop().run_in_executor(
                attacker_process, attack, attack_plan(args), target, attackers(args), args.seed, end)
        tasks = await schedule
        if pending := [task for task in tasks if not task.done()]:
            await asyncio.wait(pending, timeout=args.drain)
        cut = time.monotonic()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        at_end = await wait_idle(control, engine_url)
    stop.set()
    await sampler

    def since(t: float | None) -> float | None:
        return None if t is None else round(t - origin, 3)

    return {
        "target": target.name,
        "phases_s": {"baseline": [0.0, since(attack_start)], "attack": [since(attack_start), since(end)],
                     "cut": since(cut)},
        "victims": {"baseline": figures.victim_summary(victims, origin, attack_start, cut),
                    "attack": figures.victim_summary(victims, attack_start, end, cut)},
        "engine_preemptions": {"baseline": at_attack["preemptions_total"] - at_origin["preemptions_total"],
                               "attack": at_end["preemptions_total"] - at_attack["preemptions_total"]},
        "longest_sampling_gap_s": {"baseline": figures.longest_gap(samples, origin, attack_start),
                                   "attack": figures.longest_gap(samples, attack_start, end)},
        "attacker": {
            "fill_start_s": since(attacker.fill_start), "squeeze_start_s": since(attacker.squeeze_start),
            "room_limits_ms": [round(1e3 * v, 1) for v in attacker.limits or ()],
            **{kind: dict(Counter(r.outcome.label for r in attacker.requests if r.kind == kind))
               for kind in KINDS}},
        "detection": figures.detection(samples, attacker.fill_start, origin) if guard_url else None,
        "timeline": table(samples, origin),
        "victim_requests": [[since(o.sent), None if o.ttft is None else round(o.ttft, 4), o.label]
                            for o in (r.outcome for r in victims)],
    }


async def warm_up(target: Target, engine_url: str) -> None:
    """A few requests, not counted: first connections and first engine steps are slow."""
    async with aiohttp.ClientSession() as session:
        for index in range(3):
            body = {"model": "tiny", "prompt": f"warm-up {index}", "max_tokens": 4, "ignore_eos": True}
            await stream_completion(session, target, VICTIMS[0], body, Outcome(sent=time.monotonic()))
        await wait_idle(session, engine_url)


def detector_log(guard: Service) -> list[str]:
    """The guard's own account of every tenant's transitions, with their evidence (guard/detect/detector.py):
    the attacker's keys, and any victim's (there should be none)."""
    lines = guard.log.read_text(errors="replace").splitlines()
    return [line.split("guard.detect.detector", 1)[-1].strip(" :-") for line in lines
            if "guard.detect.detector" in line]


def command() -> str:
    """The command line that produced the report, as it could be pasted back into a shell."""
    return shlex.join([os.path.relpath(sys.executable), "-m", "bench.attacks.fill_squeeze", *sys.argv[1:]])


async def run(args: argparse.Namespace, workdir: Path) -> dict:
    engine_flags = ["--model", "tiny", "--device", "cpu", "--num-blocks", str(args.num_blocks)]
    engine = start_engine(workdir, engine_flags)
    # One process for the attacker, started (and its imports done) before any run: see attacker.attack.
    attacker_process = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    attacker_process.submit(int).result()
    try:
        direct = engine_target(engine.url, [*VICTIMS, *attackers(args)])
        await warm_up(direct, engine.url)
        unguarded = await run_scenario(direct, engine.url, None, args, attacker_process)
        config = guard_config(engine.url, args)
        guard = start_guard(workdir, config)
        try:
            via_guard = guard_target(guard.url, api_keys(args))
            await warm_up(via_guard, engine.url)
            guarded = await run_scenario(via_guard, engine.url, guard.url, args, attacker_process)
            control = await run_scenario(via_guard, engine.url, guard.url, args, None)
        finally:
            guard.stop()
        guarded["detector_log"] = detector_log(guard)
    finally:
        engine.stop()
        attacker_process.shutdown()
    for result in (unguarded, guarded, control):
        result["ttft_ratios"] = figures.ttft_ratios(result)
    guarded["ttft_vs_control"] = figures.ttft_ratios(guarded, control)
    return {
        "benchmark": "fill_squeeze",
        "quick": args.quick,
        "machine": describe(torch.device("cpu")),
        "command": command(),
        "load_average_1m": os.getloadavg()[0],
        "engine_flags": engine_flags,
        "guard_config": {**config, "engine": {"name": "primary", "url": "(the engine above)"}},
        "victims": {"tenants": list(VICTIMS), "rate_per_s_each": args.victim_rate,
                    "max_tokens": args.victim_max_tokens, "streamed": True, "ignore_eos": True},
        "attack_plan": {**asdict(attack_plan(args)), "keys": attackers(args)},
        "phases_s": {"baseline": args.baseline, "attack": args.attack, "drain": args.drain},
        "targets": figures.TARGETS,
        "runs": {"unguarded": unguarded, "guarded": guarded},
        # The same victims through the guard with no attacker: the p99 verdict's baseline, so that the two
        # are compared over the same arrivals (a burst the seeded schedule puts in the attack phase is in
        # both) rather than over two different phases.
        "control": {key: control[key] for key in ("victims", "engine_preemptions", "longest_sampling_gap_s",
                                                  "ttft_ratios")},
        "verdicts": figures.verdicts(unguarded, guarded),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fill_squeeze",
                        help="directory for report.json and the PNGs")
    parser.add_argument("--quick", action="store_true", help="a few seconds per phase: checks that it runs")
    parser.add_argument("--baseline", type=float, default=30.0, help="seconds of victims alone, per run")
    parser.add_argument("--attack", type=float, default=40.0, help="seconds of attack, per run")
    parser.add_argument("--drain", type=float, default=15.0, help="seconds the victims' last requests get")
    parser.add_argument("--num-blocks", type=int, default=96, help="the engine's KV pool (16-token blocks)")
    parser.add_argument("--victim-rate", type=float, default=2.0, help="requests per second, per victim")
    parser.add_argument("--victim-max-tokens", type=int, default=16)
    parser.add_argument("--probe-interval", type=float, default=DEFAULT_PLAN.probe_interval_s)
    parser.add_argument("--long-max-tokens", type=int, default=DEFAULT_PLAN.long_max_tokens)
    parser.add_argument("--max-longs", type=int, default=DEFAULT_PLAN.max_longs)
    parser.add_argument("--micro-rate", type=float, default=DEFAULT_PLAN.micro_rate, help="per second")
    parser.add_argument("--micro-max-tokens", type=int, default=DEFAULT_PLAN.micro_max_tokens)
    parser.add_argument("--victim-weight", type=float, default=2.0)
    parser.add_argument("--attacker-weight", type=float, default=1.0)
    parser.add_argument("--block-share", type=float, default=None,
                        help="max_blocks_share of every tenant in the guard (the same for all; default: none, "
                        "the guard's default)")
    parser.add_argument("--keys", type=int, default=1, help="API keys the attacker spreads its moves over")
    parser.add_argument("--probe-jitter", type=float, default=DEFAULT_PLAN.probe_jitter,
                        help="0..1: each probe interval drawn from probe-interval * (1 +- this)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.baseline, args.attack, args.drain = 1.5, 3.0, 1.0
    with tempfile.TemporaryDirectory(prefix="fill-squeeze-") as workdir:
        report = asyncio.run(run(args, Path(workdir)))
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out / "report.json", report, table_rows_on_one_line=True)
    plots = write_plots(report, args.out)
    print(f"machine: {report['machine']}; load average {report['load_average_1m']:.2f}")
    print(f"command: {report['command']}")
    if args.quick:
        print("QUICK RUN: phases of a few seconds, not a measurement")
    print(figures.table(report))
    print("\n".join(figures.verdict_lines(report)))
    for name, result in report["runs"].items():
        attacker = result["attacker"]
        print(f"{name} attacker: fill at {attacker['fill_start_s']} s, squeeze at "
              f"{attacker['squeeze_start_s']} s; " + "; ".join(f"{kind} {attacker[kind]}" for kind in KINDS))
    for line in report["runs"]["guarded"]["detector_log"]:
        print(f"guard: {line}")
    print(f"report: {args.out / 'report.json'}; plots: {', '.join(str(p) for p in plots)}")


if __name__ == "__main__":
    main()
