"""Noisy neighbour: what a tenant offering 10x the load does to a light interactive tenant's TTFT.

One engine process (``python -m engine --model tiny --num-blocks 128``) serves these configurations in one
run; guard processes (``python -m guard``, one per configuration, all up for the whole run) stand in front
of it for the first ones:

  (a) A alone, through the guard        A's baseline
  (b) A + B, through the guard          target: A's p99 TTFT <= 1.5x (a); once per ``--b-share``
  (c) A + B, straight to the engine     expected: A's p99 TTFT >= 3x (a)

The configurations take turns in ``--rounds`` blocks each, starting one later each round (a, b, c; b, c,
a; ...), so that a shared machine's load, which drifts over minutes, and whatever one block leaves behind
for the next weigh on all of them alike. Both tenants arrive open-loop
(bench/tenant_load.py), with the same seeded arrival times for every configuration of a round. Tenant A
sends short streamed completions; tenant B sends 10x as many requests, not streamed, with a longer
``max_tokens`` and ``ignore_eos``: more tokens than the engine can generate, so B alone saturates it. The
guard is configured as an operator would for this pair: A in the interactive lane with weight 4, B in the
batch lane with weight 1, a ``max_queue`` of 16 and a cap on its share of the KV budget
(``max_blocks_share``, the ``--b-share`` values). Straight to the engine, both send ``X-Tenant-Id`` and no
priority (without the guard, nobody sets one).

A's TTFT runs from its scheduled arrival to its first token event. When a block's arrivals end, A gets
``--drain`` seconds to finish; an A request still without a token then counts with the time it had waited
(a lower bound, and the report says how many did), and B's backlog is cancelled. Straight to the engine,
B's overload therefore lasts one block: (c)'s figures grow with the block's length.

    .venv/bin/python bench/noisy_neighbour.py [--duration 120] [--rounds 4] [--b-share 0.3 0.5] [--json PATH]
    .venv/bin/python bench/noisy_neighbour.py --quick      # one round of 2-second blocks: checks that it runs
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import torch
from latency import summarize
from run_info import command, describe, write_report
from stack import REPO, Service, get_json, start_engine, start_guard
from tenant_load import Result, Target, arrivals, engine_target, guard_target, send, status_counts

KEYS = {"a": "sk-bench-a", "b": "sk-bench-b"}
# Distinct per request from the first byte (a serial over the whole run), so no request ever hits another's
# prefix cache: every guard here shares one secret, hence one cache salt per tenant.
A_PROMPT = "{index:07d} how do I reset my password?"
B_PROMPT = "{index:07d} summarize the attached report"
SERIAL = itertools.count()
B_MAX_QUEUE = 16
TARGET_B_OVER_A = 1.5
EXPECTED_C_OVER_A = 3.0


@dataclass(frozen=True, slots=True)
class Load:
    a_rate: float
    ratio: float
    a_max_tokens: int
    b_max_tokens: int
    block: float  # seconds of arrivals per configuration and round
    drain: float

    def a_body(self, index: int) -> dict:
        return {"model": "tiny", "prompt": A_PROMPT.format(index=index), "max_tokens": self.a_max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True}

    def b_body(self, index: int) -> dict:
        return {"model": "tiny", "prompt": B_PROMPT.format(index=index), "max_tokens": self.b_max_tokens,
                "temperature": 0.0, "ignore_eos": True}


@dataclass(frozen=True, slots=True)
class Config:
    label: str
    target: Target
    with_b: bool
    b_share: float | None = None  # the guard's cap on B, for the report


@dataclass(slots=True)
class Tally:
    """What one configuration's blocks added up to, over all rounds."""

    a: list[Result] = field(default_factory=list)
    b: list[Result] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)  # seconds; lower bounds for A still waiting at a cut
    waiting_at_cut: int = 0
    b_tokens_in_window: int = 0
    preemptions: int = 0
    engine_tokens: int = 0
    load_averages: list[float] = field(default_factory=list)


def telemetry(engine: Service) -> dict:
    return get_json(engine.url + "/telemetry")


async def wait_idle(engine: Service, timeout: float = 60.0) -> None:
    """Until the engine holds no request and every block is free again: the next block starts clean."""
    deadline = time.monotonic() + timeout
    while True:
        snap = await asyncio.to_thread(telemetry, engine)
        if snap["num_running"] + snap["num_waiting"] + snap["num_swapped"] == 0 and \
                snap["free_blocks"] + snap["cached_blocks"] == snap["num_blocks"]:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine is still busy {timeout:g} s after the block: {snap}")
        await asyncio.sleep(0.1)


async def block(config: Config, load: Load, seed: int, engine: Service, tally: Tally) -> None:
    """Offer A's load (and B's, ``with_b``) to ``config.target`` for ``load.block`` seconds; tally it."""
    before = await asyncio.to_thread(telemetry, engine)
    a_results: list[Result] = []
    b_results: list[Result] = []
    # One session per tenant, without a connection cap: a client-side pool limit would be a queue of its own.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as a_session, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as b_session:
        start = time.monotonic() + 0.1
        end = start + load.block
        schedules = [arrivals(load.a_rate, seed, start, load.block,
                              lambda r: send(a_session, config.target, "a", load.a_body(next(SERIAL)), r),
                              a_results)]
        if config.with_b:
            schedules.append(arrivals(load.a_rate * load.ratio, seed + 1, start, load.block,
                                      lambda r: send(b_session, config.target, "b",
                                                        load.b_body(next(SERIAL)), r), b_results))
        a_tasks, *b_tasks = await asyncio.gather(*schedules)
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        window = await asyncio.to_thread(telemetry, engine)
        # A gets ``drain`` seconds to finish; what is left then (B's backlog) is cancelled, which closes its
        # connections, so the guard and the engine drop it at once.
        if a_tasks:
            await asyncio.wait(a_tasks, timeout=load.drain)
        cut = time.monotonic()
        pending = [task for task in a_tasks + [t for tasks in b_tasks for t in tasks] if not task.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    await wait_idle(engine)
    # An A request still waiting for its first token at the cut waited at least until then: it counts with
    # that lower bound. One that ended without a token (an error status) has no TTFT; its status is reported.
    waiting = [r for r in a_results if r.first_token is None and r.finished is None]
    tally.a += a_results
    tally.b += b_results
    tally.ttfts += [r.first_token - r.arrival for r in a_results if r.first_token is not None]
    tally.ttfts += [cut - r.arrival for r in waiting]
    tally.waiting_at_cut += len(waiting)
    tally.b_tokens_in_window += sum(r.tokens for r in b_results if r.finished is not None
                                    and r.finished <= end)
    tally.preemptions += window["preemptions_total"] - before["preemptions_total"]
    tally.engine_tokens += window["generation_tokens_total"] - before["generation_tokens_total"]
    tally.load_averages.append(os.getloadavg()[0])


def summarize_config(config: Config, tally: Tally, seconds: float) -> dict:
    return {
        "label": config.label, "target": config.target.name, "b_share": config.b_share,
        "a": {"sent": len(tally.a), "statuses": status_counts(tally.a),
              "no_token_by_cut": tally.waiting_at_cut, "ttft": summarize(tally.ttfts)},
        "b": {"sent": len(tally.b), "statuses": status_counts(tally.b),
              "tokens_per_s_in_window": tally.b_tokens_in_window / seconds},
        "engine_preemptions": tally.preemptions,
        "engine_tokens_per_s": tally.engine_tokens / seconds,
        "load_average_1m": sum(tally.load_averages) / len(tally.load_averages),
    }


def guard_config(engine_url: str, b_share: float) -> dict:
    return {
        "engine": {"name": "primary", "url": engine_url},
        "admission": {"safe_utilization": 0.85},
        "secret": "bench-noisy-neighbour",
        "tenants": [
            {"name": "a", "api_keys": [KEYS["a"]], "weight": 4, "lane": "interactive"},
            {"name": "b", "api_keys": [KEYS["b"]], "weight": 1, "lane": "batch", "max_queue": B_MAX_QUEUE,
             "max_blocks_share": b_share},
        ],
    }


async def warm_up(target: Target, load: Load) -> None:
    """A few A requests (not counted): a target's first connections and first engine steps are slow."""
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            await send(session, target, "a", {**load.a_body(next(SERIAL)), "max_tokens": 4},
                       Result(arrival=time.monotonic()))


async def run(args: argparse.Namespace, workdir: Path) -> list[dict]:
    load = Load(args.a_rate, args.ratio, args.a_max_tokens, args.b_max_tokens, args.duration / args.rounds,
                args.drain)
    engine = start_engine(workdir, args.engine_flags)
    guards: list[Service] = []
    try:
        # One guard per configuration, all up for the whole run, so that no fair-queue state crosses over
        # and every configuration shares the machine with the same processes.
        shares = [args.b_share[0], *args.b_share]
        for index, share in enumerate(shares):
            guards.append(start_guard(workdir, guard_config(engine.url, share), name=f"guard{index}"))
        targets = [guard_target(g.url, KEYS) for g in guards] + [engine_target(engine.url, list(KEYS))]
        configs = [Config("(a) A alone, through the guard", targets[0], False)]
        configs += [Config(f"(b) A + B, through the guard, B share {share:g}", target, True, share)
                    for share, target in zip(args.b_share, targets[1:])]
        configs.append(Config("(c) A + B, straight to the engine", targets[-1], True))
        for config in configs:
            await warm_up(config.target, load)
        await wait_idle(engine)
        tallies = [Tally() for _ in configs]
        for round_index in range(args.rounds):
            # The same arrival times for every configuration, and the order rotates from round to round: of
            # two identical guards run back to back, the second got ~1.5-2.5 ms lower median TTFT for A in
            # either order (likely B's prompts still in the engine's prefix cache), a bias a fixed order gives
            # to whichever configuration always follows another.
            turn = round_index % len(configs)
            for config, tally in [*zip(configs, tallies)][turn:] + [*zip(configs, tallies)][:turn]:
                await block(config, load, args.seed + 2 * round_index, engine, tally)
                print(f"  round {round_index + 1}/{args.rounds} {config.label}: done", flush=True)
    finally:
        for service in (*guards, engine):
            service.stop()
    phases = [summarize_config(config, tally, args.duration) for config, tally in zip(configs, tallies)]
    baseline = phases[0]["a"]["ttft"]
    for p in phases:
        p["ttft_over_a"] = {figure: _ratio(p["a"]["ttft"][f"{figure}_ms"], baseline[f"{figure}_ms"])
                            for figure in ("mean", "p50", "p99")}
    return phases


def _ratio(value: float | None, baseline: float | None) -> float | None:
    return value / baseline if value is not None and baseline else None


def verdicts(phases: list[dict]) -> list[dict]:
    """Each (b) against the 1.5x target, (c) against the 3x expectation."""
    out = []
    for p in phases[1:]:
        guarded = p["target"] == "guard"
        bound = TARGET_B_OVER_A if guarded else EXPECTED_C_OVER_A
        ratio = p["ttft_over_a"]["p99"]
        met = None if ratio is None else (ratio <= bound if guarded else ratio >= bound)
        out.append({"label": p["label"], "p99_over_a": ratio, "met": met,
                    "bound": f"{'<=' if guarded else '>='} {bound:g}x"})
    return out


def table(phases: list[dict]) -> str:
    head = (f"{'configuration':44} {'A sent':>6} {'A ok':>5} {'TTFT mean':>9} {'p50':>7} {'p99':>7} "
            f"{'p99/(a)':>7}  {'B sent':>6} {'B 200':>5} {'B 429':>5} {'B 503':>5} {'B tok/s':>7} "
            f"{'preempt':>7} {'load':>5}")
    rows = [head, "-" * len(head)]
    for p in phases:
        ttft = p["a"]["ttft"]
        b: Counter[str] = Counter()
        for status, count in p["b"]["statuses"].items():
            b[status.split()[0]] += count
        rows.append(f"{p['label']:44} {p['a']['sent']:>6} {p['a']['statuses'].get('200', 0):>5} "
                    f"{_ms(ttft['mean_ms']):>9} {_ms(ttft['p50_ms']):>7} {_ms(ttft['p99_ms']):>7} "
                    f"{_times(p['ttft_over_a']['p99']):>7}  {p['b']['sent']:>6} {b['200']:>5} {b['429']:>5} "
                    f"{b['503']:>5} {p['b']['tokens_per_s_in_window']:>7.0f} {p['engine_preemptions']:>7} "
                    f"{p['load_average_1m']:>5.1f}")
    return "\n".join(rows)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120.0,
                        help="seconds of arrivals per configuration, split evenly over the rounds")
    parser.add_argument("--rounds", type=int, default=4, help="blocks per configuration, interleaved")
    parser.add_argument("--drain", type=float, default=10.0,
                        help="seconds A's last requests of a block get to finish")
    parser.add_argument("--quick", action="store_true",
                        help="one round of 2-second blocks: checks that it runs, nothing more")
    parser.add_argument("--a-rate", type=float, default=2.0, help="tenant A's requests per second (2 gives "
                        "some 240 TTFTs per configuration: a p99 of fewer than 100 is simply the maximum)")
    parser.add_argument("--ratio", type=float, default=10.0, help="tenant B's rate over tenant A's")
    parser.add_argument("--a-max-tokens", type=int, default=16)
    parser.add_argument("--b-max-tokens", type=int, default=128)
    parser.add_argument("--b-share", type=float, nargs="+", default=[0.3],
                        help="B's max_blocks_share in the guard; one (b) configuration per value")
    parser.add_argument("--num-blocks", type=int, default=128, help="the engine's KV pool")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "noisy_neighbour.json")
    args = parser.parse_args()
    if args.quick:
        args.duration, args.rounds, args.drain = 2.0, 1, 1.0
    args.engine_flags = ["--model", "tiny", "--device", "cpu", "--num-blocks", str(args.num_blocks)]
    started_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="noisy-neighbour-") as workdir:
        phases = asyncio.run(run(args, Path(workdir)))
    report = {
        "benchmark": "noisy_neighbour", "machine": describe(torch.device("cpu")), "command": command(),
        "load_average_1m_at_start": started_load, "engine_flags": args.engine_flags,
        "load": {"a_rate_per_s": args.a_rate, "b_rate_per_s": args.a_rate * args.ratio,
                 "a_max_tokens": args.a_max_tokens, "b_max_tokens": args.b_max_tokens,
                 "duration_s": args.duration, "rounds": args.rounds, "drain_s": args.drain, "seed": args.seed,
                 "a": "interactive lane, weight 4, streamed",
                 "b": f"batch lane, weight 1, max_queue {B_MAX_QUEUE}, not streamed, ignore_eos"},
        "phases": phases, "verdicts": verdicts(phases),
    }
    print(f"machine: {report['machine']}; load average at start {started_load:.2f}")
    print(f"command: {report['command']}")
    if args.quick:
        print("QUICK RUN: blocks of a few seconds, not a measurement")
    print(table(phases))
    for p in phases:
        if refused := {status: n for status, n in p["a"]["statuses"].items() if status != "200"}:
            print(f"{p['label']}: A requests not served: {refused}")
        if p["a"]["no_token_by_cut"]:
            print(f"{p['label']}: {p['a']['no_token_by_cut']} A requests had no token by the cut "
                  "(counted with the time they had waited: the TTFT figures are lower bounds)")
    for v in report["verdicts"]:
        print(f"A's p99 TTFT {v['label']}: {_times(v['p99_over_a'])} of (a) (want {v['bound']}: "
              f"{'met' if v['met'] else 'NOT met'})")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_report(args.json, report)
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
