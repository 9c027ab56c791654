"""Issue 15: three engine replicas behind one guard, the four routing policies side by side on the same
seeded multi-turn chat workload (bench/conversations.py: a system prompt per tenant, each turn's prompt the
whole conversation so far).

Three engine processes serve every run (``tiny`` by default, whose byte tokenizer makes a character a token);
each run of a policy gets a guard process of its own (``routing.policy``) and tenant names of its own, so its
cache salts are new to the engines and nothing an earlier run cached can hit: every figure below is the
run's own (deltas of the engines' and the guard's counters). A warm-up tenant touches every replica first
(first steps are slow). Each policy runs ``--rounds`` times, the order of the policies reversed every other
round, so that on a shared machine no policy always meets the same neighbours; its figures pool its rounds.

Per policy:

- hit ratio: the engines' own prefix-cache hit tokens over query tokens, summed over the replicas;
- TTFT p50/p99: client side, streamed, from the send to the first content chunk;
- output tokens/s: completion tokens over the run's wall time (first send to last answer);
- preemptions: the engines' ``preemptions_total``, summed;
- load per replica: answered requests by ``X-Guard-Backend`` (and their prompt tokens), shares, and the
  busiest replica's requests over the mean;
- prefix hits per replica: the guard's predicted tokens (``guard_prefix_predicted_hit_tokens_total``), the
  guard's record of the engine's report (``guard_prefix_reported_hit_tokens_total``), the engine's counter.

Before the runs, what a prefix hit saves on this machine: a prompt as long as the workload's longest, sent to
one replica cold and then again (cached), three times each.

Goals (issue 15): kvguard's hit ratio >= 2x round_robin's; its TTFT p50 below round_robin's and
least_loaded's; no replica above 1.5x the mean load.

    .venv/bin/python -m bench.routing [--out bench/results/routing] [--tenants 4] [--turns 5] ...
    .venv/bin/python -m bench.routing --quick      # a toy workload in seconds: checks that it runs
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import torch

from bench.conversations import ChatWorkload, Turn, plan, run_conversations
from bench.latency import summarize
from bench.routing_plots import write_plots
from bench.run_info import describe, write_report
from bench.stack import REPO, Service, backend_series, get_json, start_engine, start_guard

POLICIES = ("round_robin", "least_loaded", "prefix", "kvguard")
REPLICAS = 3
# The guard's per-replica series a run reports, by their names in the report.
ENGINE_COUNTERS = ("prefix_cache_hits_total", "prefix_cache_queries_total", "preemptions_total")
GUARD_SERIES = {"guard_routed_requests": "guard_routed_requests_total",
                "guard_predicted_hit_tokens": "guard_prefix_predicted_hit_tokens_total",
                "guard_reported_hit_tokens": "guard_prefix_reported_hit_tokens_total",
                "guard_reported_query_tokens": "guard_prefix_reported_query_tokens_total"}
HIT_RATIO_GOAL, LOAD_GOAL = 2.0, 1.5  # kvguard's hit ratio over round_robin's; busiest replica over the mean
REQUEST_TIMEOUT_S = 300.0


def tenant_keys(policy: str, tenants: int) -> dict[str, str]:
    return {f"{policy}-{i}": f"sk-bench-{policy}-{i}" for i in range(tenants)}


def guard_config(engines: list[Service], policy: str, keys: dict[str, str]) -> dict:
    tenants = [{"name": name, "api_keys": [key], "lane": "interactive", "max_queue": 1024}
               for name, key in keys.items()]
    return {"engines": [{"name": f"e{i}", "url": engine.url} for i, engine in enumerate(engines)],
            "routing": {"policy": policy}, "secret": "bench-routing", "tenants": tenants}


def snapshots(engines: list[Service]) -> list[dict]:
    return [get_json(engine.url + "/telemetry") for engine in engines]


async def prefill_cost(url: str, model: str, tokens: int, repeats: int = 3) -> dict:
    """One replica's time for a ``tokens``-token prompt (token ids, one output token, not streamed) cold,
    then again from its prefix cache; medians of ``repeats`` prompts, each under a salt of its own."""
    cold, cached, hit = [], [], 0
    async with aiohttp.ClientSession() as session:
        for repeat in range(repeats):
            body = {"model": model, "prompt": [32 + (i * 7 + repeat) % 90 for i in range(tokens)],
                    "max_tokens": 1, "cache_salt": f"prefill-probe-{repeat}-{time.time_ns()}"}
            for times in (cold, cached):
                start = time.perf_counter()
                async with session.post(url + "/v1/completions", json=body) as answer:
                    usage = (await answer.json())["usage"]
                times.append(time.perf_counter() - start)
            hit = usage["prompt_tokens_details"]["cached_tokens"]
    cold_s, cached_s = statistics.median(cold), statistics.median(cached)
    return {"prompt_tokens": tokens, "cold_ms": round(1e3 * cold_s, 1), "cached_ms": round(1e3 * cached_s, 1),
            "cached_tokens": hit, "cold_us_per_token": round(1e6 * cold_s / tokens, 1),
            "cold_over_cached": round(cold_s / cached_s, 1)}


def longest_prompt(workload: ChatWorkload, tenants: int) -> int:
    """Characters of the workload's longest prompt text (tokens for ``tiny``), as the messages' contents,
    answers counted at ``max_tokens`` characters; the chat template adds a few more."""
    return max(len(c.system) + sum(len(u) for u in c.users) + workload.max_tokens * (len(c.users) - 1)
               for c in plan(workload, [str(i) for i in range(tenants)]))


@dataclass(slots=True)
class Round:
    """One policy's pass over the workload: its turns, and what the engines and the guard counted meanwhile
    (deltas by replica, in replica order for the engines and by name for the guard)."""

    turns: list[Turn]
    engine: dict[str, list[int]]  # ENGINE_COUNTERS
    guard: dict[str, dict[str, float]]  # GUARD_SERIES
    wall_s: float


async def run_round(policy: str, index: int, engines: list[Service], workload: ChatWorkload,
                    args: argparse.Namespace, workdir: Path) -> Round:
    """The workload through a guard with ``policy``, under tenant names of the round's own."""
    keys = tenant_keys(f"{policy}-r{index}", args.tenants)
    guard = start_guard(workdir, guard_config(engines, policy, keys), name=f"guard-{policy}-r{index}")
    try:
        before, guard_before = snapshots(engines), guard_counters(guard)
        started = time.monotonic()
        turns = await run_conversations(guard.url, keys, workload, args.model, REQUEST_TIMEOUT_S)
        wall_s = time.monotonic() - started
        after, guard_after = snapshots(engines), guard_counters(guard)
    finally:
        guard.stop()
    engine = {counter: [a[counter] - b[counter] for a, b in zip(after, before, strict=True)]
              for counter in ENGINE_COUNTERS}
    guard_deltas = {key: {name: value - guard_before[key].get(name, 0.0) for name, value in values.items()}
                    for key, values in guard_after.items()}
    return Round(turns, engine, guard_deltas, wall_s)


def guard_counters(guard: Service) -> dict[str, dict[str, float]]:
    """``GUARD_SERIES`` by replica, read before and after a run: like the engines', its figures are deltas."""
    return {key: backend_series(guard.url, series) for key, series in GUARD_SERIES.items()}


def summarize_rounds(rounds: list[Round]) -> dict:
    """A policy's figures over its rounds together (and each round's hit ratio, TTFT p50 and wall time)."""
    def total(counter: str) -> list[int]:
        return [sum(values) for values in zip(*(r.engine[counter] for r in rounds), strict=True)]

    hits, queries = total("prefix_cache_hits_total"), total("prefix_cache_queries_total")
    turns = [turn for r in rounds for turn in r.turns]
    answered = [t for t in turns if t.outcome == "completed"]
    requests = Counter(t.backend for t in answered)
    prompt_tokens: Counter[str] = Counter()
    for turn in answered:
        prompt_tokens[turn.backend] += turn.prompt_tokens
    replicas = {}
    for index, name in enumerate(f"e{i}" for i in range(len(hits))):
        replicas[name] = {
            "requests": requests[name],
            "share": round(requests[name] / len(answered), 3) if answered else None,
            "prompt_tokens": prompt_tokens[name],
            "engine_hit_tokens": hits[index],
            "engine_query_tokens": queries[index],
            **{key: sum(r.guard[key].get(name, 0.0) for r in rounds) for key in GUARD_SERIES},
        }
    busy_s = sum(max(t.finished for t in r.turns) - min(t.sent for t in r.turns) for r in rounds)
    return {
        "requests": len(turns),
        "outcomes": dict(Counter(t.outcome for t in turns)),
        "hit_ratio": round(sum(hits) / sum(queries), 4) if sum(queries) else None,
        "hit_tokens": sum(hits),
        "query_tokens": sum(queries),
        "ttft": summarize([t.ttft for t in answered if t.ttft is not None]),
        "output_tokens_per_s": round(sum(t.completion_tokens for t in answered) / busy_s, 1),
        "preemptions": sum(total("preemptions_total")),
        "replicas": replicas,
        "max_load_over_mean": round(max(requests.values()) / (len(answered) / len(replicas)), 3)
                              if answered else None,
        "predicted_hit_tokens": sum(replica["guard_predicted_hit_tokens"] for replica in replicas.values()),
        "rounds": [round_figures(r) for r in rounds],
    }


def round_figures(run: Round) -> dict:
    hits, queries = sum(run.engine["prefix_cache_hits_total"]), sum(run.engine["prefix_cache_queries_total"])
    p50 = summarize([t.ttft for t in run.turns if t.ttft is not None])["p50_ms"]
    return {"hit_ratio": round(hits / queries, 4) if queries else None, "ttft_p50_ms": _round(p50),
            "wall_s": round(run.wall_s, 2)}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def verdicts(runs: dict[str, dict]) -> dict[str, dict]:
    """Issue 15's goals, each with the figures it was judged on."""
    kvguard, round_robin = runs["kvguard"], runs["round_robin"]
    ratio = kvguard["hit_ratio"] / round_robin["hit_ratio"] if round_robin["hit_ratio"] else None
    p50s = [runs[policy]["ttft"]["p50_ms"] for policy in ("kvguard", "round_robin", "least_loaded")]
    return {
        "hit_ratio_2x_round_robin": {"value": None if ratio is None else round(ratio, 2),
                                     "met": ratio is not None and ratio >= HIT_RATIO_GOAL},
        "ttft_p50_below_round_robin_and_least_loaded": {
            "value": [_round(p50) for p50 in p50s],
            "met": None not in p50s and p50s[0] < min(p50s[1:])},
        "max_load_within_1_5x_mean": {"value": kvguard["max_load_over_mean"],
                                      "met": kvguard["max_load_over_mean"] <= LOAD_GOAL},
    }


async def warm_up(engines: list[Service], args: argparse.Namespace, workdir: Path) -> None:
    """A short run under a tenant of its own, not counted: first connections and first steps are slow."""
    keys = {"warm-up": "sk-bench-warm-up"}
    guard = start_guard(workdir, guard_config(engines, "round_robin", keys), name="guard-warm-up")
    try:
        warm = ChatWorkload(conversations=REPLICAS, turns=1, system_words=8, user_words=8, max_tokens=4)
        await run_conversations(guard.url, keys, warm, args.model, REQUEST_TIMEOUT_S)
    finally:
        guard.stop()


def workload_of(args: argparse.Namespace) -> ChatWorkload:
    return ChatWorkload(conversations=args.conversations, turns=args.turns, system_words=args.system_words,
                        user_words=args.user_words, max_tokens=args.max_tokens, stagger_s=args.stagger,
                        think_s=args.think, seed=args.seed)


async def run(args: argparse.Namespace, workdir: Path) -> dict:
    workload = workload_of(args)
    flags = ["--model", args.model, "--device", "cpu", "--num-blocks", str(args.num_blocks)]
    with ThreadPoolExecutor(REPLICAS) as pool:  # the replicas load at once
        starting = [pool.submit(start_engine, workdir, flags, None, f"e{i}") for i in range(REPLICAS)]
    engines = [future.result() for future in starting if future.exception() is None]
    try:
        if failed := [future.exception() for future in starting if future.exception() is not None]:
            raise failed[0]
        longest = longest_prompt(workload, args.tenants)
        prefill = await prefill_cost(engines[0].url, args.model, longest)
        if not args.quick:
            await warm_up(engines, args, workdir)
        rounds: dict[str, list[Round]] = {policy: [] for policy in POLICIES}
        for index in range(args.rounds):  # the order alternates, so that no policy always goes first
            for policy in POLICIES if index % 2 == 0 else POLICIES[::-1]:
                rounds[policy].append(await run_round(policy, index, engines, workload, args, workdir))
                figures = summarize_rounds(rounds[policy][-1:])
                print(f"round {index + 1}, {policy}: {line(figures)}", flush=True)
        runs = {policy: summarize_rounds(rounds[policy]) for policy in POLICIES}
    finally:
        for engine in engines:
            engine.stop()
    return {
        "benchmark": "routing",
        "quick": args.quick,
        "machine": describe(torch.device("cpu")),
        "command": command(),
        "load_average_1m": os.getloadavg()[0],
        "engine_flags": flags,
        "replicas": REPLICAS,
        "tenants": args.tenants,
        "workload": asdict(workload),
        "rounds": args.rounds,
        "requests_per_policy": args.tenants * args.conversations * args.turns * args.rounds,
        "longest_prompt_chars": longest,
        "prefill": prefill,
        "runs": runs,
        "verdicts": verdicts(runs),
    }


def line(run: dict) -> str:
    ttft = run["ttft"]
    loads = " ".join(f"{name} {replica['requests']}" for name, replica in run["replicas"].items())
    return (f"hit ratio {run['hit_ratio']}, TTFT p50 {ttft['p50_ms'] or 0:.0f} ms, "
            f"p99 {ttft['p99_ms'] or 0:.0f} ms, {run['output_tokens_per_s']} output tok/s, "
            f"{run['preemptions']} preemptions, load {loads} (max/mean {run['max_load_over_mean']}), "
            f"{run['outcomes']}, {sum(r['wall_s'] for r in run['rounds']):.1f} s")


TABLE_HEADER = ("| policy | hit ratio | TTFT p50 ms | TTFT p99 ms | output tok/s | preemptions "
                "| requests per replica (e0/e1/e2) | max/mean load "
                "| predicted / engine-reported hit tokens |\n"
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def table(report: dict) -> str:
    """The runs as the Markdown table docs/benchmarks/routing.md quotes."""
    rows = [TABLE_HEADER]
    for policy, run in report["runs"].items():
        loads = "/".join(str(replica["requests"]) for replica in run["replicas"].values())
        ttft = run["ttft"]
        rows.append(f"| {policy} | {run['hit_ratio']:.3f} | {ttft['p50_ms']:.0f} | {ttft['p99_ms']:.0f} | "
                    f"{run['output_tokens_per_s']:.1f} | {run['preemptions']} | "
                    f"{loads} | {run['max_load_over_mean']:.2f} | "
                    f"{run['predicted_hit_tokens']:,.0f} / {run['hit_tokens']:,} |")
    return "\n".join(rows)


def command() -> str:
    """The command line that produced the report, as it could be pasted back into a shell."""
    return shlex.join([os.path.relpath(sys.executable), "-m", "bench.routing", *sys.argv[1:]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "routing",
                        help="directory for routing.json and the PNGs")
    parser.add_argument("--quick", action="store_true", help="a toy workload in seconds: checks that it runs")
    parser.add_argument("--model", default="tiny", help="what each replica serves (python -m engine --model)")
    parser.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per replica (16 tokens each)")
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=5, help="per tenant")
    parser.add_argument("--turns", type=int, default=6, help="per conversation")
    parser.add_argument("--system-words", type=int, default=16, help="each tenant's system prompt")
    parser.add_argument("--user-words", type=int, default=30, help="a user message's mean")
    parser.add_argument("--max-tokens", type=int, default=32, help="each answer")
    parser.add_argument("--stagger", type=float, default=2.0, help="seconds over which conversations start")
    parser.add_argument("--think", type=float, default=0.5,
                        help="most seconds between an answer and the next turn")
    parser.add_argument("--rounds", type=int, default=3,
                        help="passes of every policy over the workload, in alternating order")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.tenants, args.conversations, args.turns, args.rounds = 2, 2, 2, 1
        args.system_words, args.user_words, args.max_tokens, args.stagger, args.think = 16, 8, 4, 0.2, 0.0
    with tempfile.TemporaryDirectory(prefix="routing-") as workdir:
        report = asyncio.run(run(args, Path(workdir)))
    args.out.mkdir(parents=True, exist_ok=True)
    write_report(args.out / "routing.json", report)
    plots = write_plots(report, args.out)
    print(f"machine: {report['machine']}; load average {report['load_average_1m']:.2f}")
    print(f"command: {report['command']}")
    if args.quick:
        print("QUICK RUN: a toy workload, not a measurement")
    prefill = report["prefill"]
    print(f"prefill of a {prefill['prompt_tokens']}-token prompt: {prefill['cold_ms']} ms cold "
          f"({prefill['cold_us_per_token']} us/token), {prefill['cached_ms']} ms cached "
          f"({prefill['cached_tokens']} tokens from the cache): {prefill['cold_over_cached']}x")
    print(table(report))
    for name, verdict in report["verdicts"].items():
        print(f"{name}: {verdict['value']} -> {'met' if verdict['met'] else 'NOT met'}")
    print(f"report: {args.out / 'routing.json'}; plots: {', '.join(str(p) for p in plots)}")


if __name__ == "__main__":
    main()
