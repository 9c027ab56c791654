"""Chats without ``max_tokens`` against the same chats with exact ``max_tokens``, side by side (issue 14).

Chat clients mostly send no ``max_tokens`` (the OpenAI SDKs' default). The guard then reserves a predicted
output instead of the context's room (guard/admission/predictor.py) and grows the reservation while the
stream passes it. One SmolLM2 engine process (CPU) serves four guard processes, two arms in each of two
configurations:

  arms            no_max    the clients never send ``max_tokens``
                  exact     each request's ``max_tokens`` is the number of tokens that request generates
  configurations  fallback  the guard's defaults and a static fallback: what goes elsewhere is counted
                  queue     the same without a fallback: a saturated guard queues everything on the primary,
                            so TTFT and preemptions cover the whole workload

The fallback is the static message, so that a request sent elsewhere is counted (``X-Guard-Route``) without
a second model taking the primary's CPU; a request it answered is an answer, and its client moves on. At
twice the capacity the guard's saturation (blocks committed plus queued, over the pool) passes its
``degraded_enter`` (1.5) with exact bounds already, and in degraded mode every new request goes to the
fallback: "fallback" measures that, "queue" what the primary alone makes of the load.

Exact comes from calibration: every prompt once through each no_max guard, both passes at once, the queue
guard's eight at a time and the fallback guard's two at a time (two 512-token reservations, a fresh guard's
prediction, are a saturation of 1.1 on 64 blocks: under ``degraded_enter``, so its pass stays on the
primary). Greedy decoding makes an answer a function of its prompt, so its ``completion_tokens`` (EOS
included, as the engine counts it) is the prompt's exact bound; the passes also give each no_max guard the
history of outputs a running guard has (a fresh one predicts 512 tokens for its first eight requests: a
start-up effect that would dominate the p99 of a few dozen requests).

The prompts are chat questions whose greedy SmolLM2 answer ends by itself, from 8 to about 300 tokens (a
chat's spread: mostly short, a long tail); a question SmolLM2 answers in an endless loop would run a no-max
request to the end of its window, minutes on a CPU. The engine's window is cut to its pool's token slots
(``--max-model-len``): the guard bounds a request without ``max_tokens`` by the window alone and sends that
bound, which an engine whose pool holds fewer slots refuses.

Load: closed loop at ``--load`` (2) times the engine's capacity. Capacity = the guard's KV budget
(``safe_utilization`` x ``--num-blocks``) over the mean blocks of a request at its exact size (prompt plus
completion, from the calibration); that many clients (rounded) each send the next request of the workload
as soon as their last one is answered. The workload is every prompt ``--passes`` times in one seeded order,
the same for every guard; each round runs it once through each guard, the guards taking turns (the first
one rotates per round, so a shared machine's drifting load weighs on all). Every guard has one tenant in the
interactive lane with a queueing timeout of ``LANE_TIMEOUT_S``: a CPU serves SmolLM2 some hundred times
slower than a GPU serves a model of its size, and a 10-second deadline would turn queueing into 503s in both
arms, a question apart from this one.

Reported per configuration and arm: TTFT (send to the first SSE event, over the answers the primary served)
and the p99 ratio no_max / exact; engine preemptions (its telemetry) as a share of the requests the primary
served (goal <= 1%); fallback routes (goal 0 while the primary is healthy); reservation growths granted and
denied and mode transitions (the guard's ``/metrics``); and, sampled every ``SAMPLE_S``, the guard's mode,
the blocks it had reserved on the primary against those the engine used, and the requests running there.

    .venv/bin/python bench/no_max_tokens.py [--num-blocks 64] [--load 2] [--passes 1] [--rounds 1] [--json PATH]
    .venv/bin/python bench/no_max_tokens.py --quick    # three short questions, one round: checks that it runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import torch
from latency import summarize
from noisy_neighbour import wait_idle
from run_info import command, describe, write_report
from soak import metric_samples, metric_sum
from stack import REPO, Service, get_json, start_engine, start_guard

from guard.config import Admission
from guard.pool.gate import blocks_for

MODEL = "smollm2"
SMOLLM2_WINDOW = 8192
BLOCK_SIZE = 16
KEY = "sk-bench-chat"
LANE_TIMEOUT_S = 600.0
SAMPLE_S = 0.5
TARGET_PREEMPTION_SHARE = 0.01
ARMS = ("no_max", "exact")
CONFIGS = {"fallback": "static", "queue": None}  # configuration -> the name of its guards' fallback
CALIBRATION_CLIENTS = {"fallback": 2, "queue": 8}  # see the module docstring
# Greedy SmolLM2 ends each of these by itself (EOS), from a sentence to a few paragraphs; the short ones first.
PROMPTS = [
    "What is the capital of France?", "What is the capital of Germany?", "What is the capital of Japan?",
    "What is the capital of Italy? Answer in one sentence.", "How many days are in a week?",
    "Translate 'good morning' into Spanish.", "Answer with one word: what color is the sky?",
    "What is 2 plus 2?", "Give me a name for a pet turtle.", "List three primary colors.",
    "Describe a cat in two sentences.", "Explain how a bicycle works.", "What is the capital of Spain?",
    "Say hello in French.", "Answer yes or no: is water wet?", "What is the boiling point of water in Celsius?",
    "Name the largest planet in the solar system.", "What is the chemical symbol for gold?",
    "What are the planets in our solar system?", "What is the speed of light?",
    "What is the tallest mountain in the world?", "What does a computer's CPU do?", "What is 12 times 7?",
    "Give me three tips for better sleep.", "What is photosynthesis?", "What is machine learning?",
    "Describe the water cycle.", "What is the difference between weather and climate?", "Why is the sky blue?",
    "Explain what a black hole is.", "How do vaccines work?",
]
QUICK_PROMPTS = PROMPTS[:3]


@dataclass(slots=True)
class Answer:
    """One chat request as its client saw it."""

    prompt: int  # index into the prompts
    sent: float  # time.monotonic
    status: int | None = None  # None: no answer (a transport error)
    route: str | None = None  # X-Guard-Route: the fallback that answered; None: the primary
    first_event: float | None = None
    finished: float | None = None
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str = ""

    @property
    def served_by_primary(self) -> bool:
        return self.status == 200 and self.route is None


@dataclass(slots=True)
class Arm:
    """What one guard's blocks added up to, over all rounds."""

    answers: list[Answer] = field(default_factory=list)
    seconds: float = 0.0
    preemptions: int = 0
    growths: Counter[str] = field(default_factory=Counter)
    mode_transitions: float = 0.0
    samples: list[dict] = field(default_factory=list)
    load_averages: list[float] = field(default_factory=list)


def chat_body(question: str, max_tokens: int | None) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    return body if max_tokens is None else {**body, "max_tokens": max_tokens}


async def send(session: aiohttp.ClientSession, url: str, question: str, index: int,
               max_tokens: int | None) -> Answer:
    """One streamed chat through the guard at ``url``, read to its end."""
    answer = Answer(prompt=index, sent=time.monotonic())
    try:
        async with session.post(url + "/v1/chat/completions", json=chat_body(question, max_tokens),
                                headers={"Authorization": f"Bearer {KEY}"}) as response:
            answer.status, answer.route = response.status, response.headers.get("X-Guard-Route")
            if response.status != 200:
                answer.error = (await response.text())[:200]
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                answer.first_event = answer.first_event or time.monotonic()
                event = json.loads(line[6:])
                for choice in event.get("choices") or ():
                    answer.finish_reason = choice.get("finish_reason") or answer.finish_reason
                if usage := event.get("usage"):
                    answer.completion_tokens = usage["completion_tokens"]
    except aiohttp.ClientError as exc:
        answer.status, answer.error = None, repr(exc)
    answer.finished = time.monotonic()
    return answer


async def closed_loop(url: str, prompts: list[str], order: list[int], clients: int,
                      max_tokens: dict[int, int] | None) -> list[Answer]:
    """``clients`` clients work through ``order``, each sending its next request once its last one was
    answered; ``max_tokens`` maps a prompt to its bound (None: no bound is sent)."""
    pending = iter(order)
    answers: list[Answer] = []

    async def client(session: aiohttp.ClientSession) -> None:
        for index in pending:  # one shared iterator: each request is taken by exactly one client
            bound = None if max_tokens is None else max_tokens[index]
            answers.append(await send(session, url, prompts[index], index, bound))

    timeout = aiohttp.ClientTimeout(total=None, sock_read=LANE_TIMEOUT_S + 60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return answers


def scrape(guard: Service) -> str:
    """The guard's /metrics page."""
    with urllib.request.urlopen(guard.url + "/metrics", timeout=5.0) as page:
        return page.read().decode()


def label(labels: str) -> str:
    """The value of a series' one label, as ``metric_samples`` keys it (``result="granted"``: granted)."""
    return labels.split('"')[1]


def guard_counters(guard: Service) -> tuple[Counter[str], float]:
    """Reservation growths by result, and mode transitions (all of them), as the guard's /metrics has them."""
    page = scrape(guard)
    growths = Counter({label(labels): value
                       for labels, value in metric_samples(page, "guard_reservation_growths_total").items()})
    return growths, metric_sum(page, "guard_mode_transitions_total")


def guard_mode(page: str) -> str:
    return next((label(labels) for labels, value in metric_samples(page, "guard_mode").items() if value == 1.0),
                "unknown")


async def sample(stop: asyncio.Event, engine: Service, guard: Service, samples: list[dict]) -> None:
    """Every ``SAMPLE_S`` until ``stop``: the guard's mode and reservations on the primary, the engine's use."""
    while not stop.is_set():
        try:
            page = await asyncio.to_thread(scrape, guard)
            snap = await asyncio.to_thread(get_json, engine.url + "/telemetry")
        except (OSError, ValueError):
            page = None  # a read that failed skips this tick
        if page is not None:
            samples.append({"mode": guard_mode(page),
                            "reserved_blocks": metric_sum(page, "guard_backend_reserved_blocks"),
                            "used_blocks": snap["num_blocks"] - snap["free_blocks"] - snap["cached_blocks"],
                            "running": snap["num_running"], "waiting": snap["num_waiting"]})
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_S)
        except TimeoutError:
            pass


async def wait_normal(guard: Service, timeout: float = 60.0) -> None:
    """Until the guard is back in normal mode (its dwell times pass after a block's load)."""
    deadline = time.monotonic() + timeout
    while guard_mode(await asyncio.to_thread(scrape, guard)) != "normal":
        if time.monotonic() > deadline:
            raise RuntimeError(f"the guard at {guard.url} is not back in normal mode after {timeout:g} s")
        await asyncio.sleep(0.5)


async def block(arm: Arm, engine: Service, guard: Service, prompts: list[str], order: list[int], clients: int,
                max_tokens: dict[int, int] | None) -> None:
    """One pass of the workload through ``guard``, tallied into ``arm``."""
    await wait_idle(engine)
    await wait_normal(guard)
    before = await asyncio.to_thread(get_json, engine.url + "/telemetry")
    growths, transitions = guard_counters(guard)
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(stop, engine, guard, arm.samples))
    started = time.monotonic()
    arm.answers += await closed_loop(guard.url, prompts, order, clients, max_tokens)
    arm.seconds += time.monotonic() - started
    stop.set()
    await sampler
    await wait_idle(engine)
    after = await asyncio.to_thread(get_json, engine.url + "/telemetry")
    growths_after, transitions_after = guard_counters(guard)
    arm.preemptions += after["preemptions_total"] - before["preemptions_total"]
    arm.growths.update(growths_after - growths)
    arm.mode_transitions += transitions_after - transitions
    arm.load_averages.append(os.getloadavg()[0])


def calibrate(answers: list[Answer], prompts: list[str]) -> dict[int, int]:
    """Each prompt's exact bound: its completion tokens, from an answer the primary served to its end."""
    bounds = {a.prompt: a.completion_tokens for a in answers if a.served_by_primary and a.finish_reason == "stop"}
    if missing := sorted(set(range(len(prompts))) - set(bounds)):
        raise RuntimeError(f"calibration: no complete answer from the primary for {[prompts[i] for i in missing]}: "
                           f"{[asdict(a) for a in answers if a.prompt in missing]}")
    return bounds


def prompt_tokens(engine: Service, prompts: list[str]) -> list[int]:
    """Each chat's prompt tokens, as the engine counts them (its chat template included)."""
    counts = []
    for question in prompts:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": question}]}).encode()
        request = urllib.request.Request(engine.url + "/tokenize", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            counts.append(json.load(answer)["count"])
    return counts


def summarize_arm(arm: Arm, exact: dict[int, int]) -> dict:
    primary = [a for a in arm.answers if a.served_by_primary]
    samples = arm.samples or [{"mode": "unknown", "reserved_blocks": 0, "used_blocks": 0, "running": 0,
                               "waiting": 0}]
    mean = {key: sum(s[key] for s in samples) / len(samples)
            for key in ("reserved_blocks", "used_blocks", "running", "waiting")}
    tokens = sum(a.completion_tokens for a in primary)
    return {
        "requests": len(arm.answers),
        "statuses": dict(Counter(f"{a.status} {a.route}" if a.route else str(a.status) for a in arm.answers)),
        "served_by_primary": len(primary),
        "fallback_routes": sum(a.route is not None for a in arm.answers),
        "ttft": summarize([a.first_event - a.sent for a in primary if a.first_event is not None]),
        "e2e": summarize([a.finished - a.sent for a in primary if a.finished is not None]),
        "completion_tokens": tokens, "tokens_per_s": tokens / arm.seconds if arm.seconds else 0.0,
        "same_length_as_calibration": sum(a.completion_tokens == exact[a.prompt] for a in primary),
        "seconds": arm.seconds,
        "engine_preemptions": arm.preemptions,
        "preemption_share": arm.preemptions / len(primary) if primary else None,
        "growths": {"granted": arm.growths["granted"], "denied": arm.growths["denied"]},
        "mode_transitions": arm.mode_transitions,
        "time_in_mode": {mode: n / len(samples) for mode, n in Counter(s["mode"] for s in samples).items()},
        "mean_reserved_blocks": mean["reserved_blocks"], "mean_used_blocks": mean["used_blocks"],
        "mean_running": mean["running"], "mean_waiting_in_engine": mean["waiting"],
        "load_average_1m": sum(arm.load_averages) / len(arm.load_averages),
    }


def verdicts(arms: dict[str, dict]) -> dict:
    no_max, exact = arms["no_max"], arms["exact"]
    ratio = (no_max["ttft"]["p99_ms"] / exact["ttft"]["p99_ms"]
             if no_max["ttft"]["p99_ms"] and exact["ttft"]["p99_ms"] else None)
    share = no_max["preemption_share"]
    return {"p99_ttft_no_max_over_exact": ratio, "no_max_preemption_share": share,
            "no_max_preemptions_within_goal": share is not None and share <= TARGET_PREEMPTION_SHARE,
            "no_max_fallback_routes": no_max["fallback_routes"], "exact_fallback_routes": exact["fallback_routes"]}


def guard_config(engine_url: str, requests: int, fallback: str | None) -> dict:
    fallbacks = [{"name": fallback, "message": "The service is degraded; please retry shortly."}] if fallback else []
    return {"engine": {"name": "primary", "url": engine_url}, "fallbacks": fallbacks,
            "secret": "bench-no-max-tokens",  # one secret, one cache salt: every guard meets the same prefix cache
            "lanes": {"interactive": {"priority": 1, "timeout": LANE_TIMEOUT_S}},
            "tenants": [{"name": "chat", "api_keys": [KEY], "lane": "interactive", "max_queue": requests}]}


async def run(args: argparse.Namespace, workdir: Path) -> dict:
    prompts = QUICK_PROMPTS if args.quick else PROMPTS
    everything = list(range(len(prompts)))
    engine = start_engine(workdir, args.engine_flags)
    guards: dict[tuple[str, str], Service] = {}
    try:
        # One guard per configuration and arm, so that no prediction history or mode crosses over.
        keys = [(config, arm) for config in CONFIGS for arm in ARMS]
        started = await asyncio.gather(*(asyncio.to_thread(
            start_guard, workdir, guard_config(engine.url, len(prompts) * args.passes, CONFIGS[config]),
            name=f"{config}-{arm}") for config, arm in keys), return_exceptions=True)
        guards.update((key, s) for key, s in zip(keys, started, strict=True) if isinstance(s, Service))
        if failed := [s for s in started if isinstance(s, BaseException)]:
            raise failed[0]
        calibration = dict(zip(CONFIGS, await asyncio.gather(*(
            closed_loop(guards[config, "no_max"].url, prompts, everything, CALIBRATION_CLIENTS[config], None)
            for config in CONFIGS)), strict=True))
        exact = calibrate(calibration["queue"], prompts)
        counts = prompt_tokens(engine, prompts)
        snap = await asyncio.to_thread(get_json, engine.url + "/telemetry")
        budget = int(Admission().safe_utilization * snap["num_blocks"])
        mean_blocks = sum(blocks_for(snap["block_size"], counts[i], exact[i]) for i in everything) / len(prompts)
        capacity = budget / mean_blocks
        clients = args.clients or max(1, round(args.load * capacity))
        order = [i for _ in range(args.passes) for i in everything]
        random.Random(args.seed).shuffle(order)
        arms = {key: Arm() for key in keys}
        for round_index in range(args.rounds):
            turn = round_index % len(keys)
            for config, arm in keys[turn:] + keys[:turn]:
                await block(arms[config, arm], engine, guards[config, arm], prompts, order, clients,
                            exact if arm == "exact" else None)
                print(f"  round {round_index + 1}/{args.rounds}, {config} {arm}: done", flush=True)
    finally:
        for service in (*guards.values(), engine):
            service.stop()
    configs = {}
    for config, fallback in CONFIGS.items():
        summaries = {arm: summarize_arm(arms[config, arm], exact) for arm in ARMS}
        configs[config] = {"fallback": fallback, "arms": summaries, "verdicts": verdicts(summaries)}
    return {
        "workload": {"prompts": len(prompts), "passes": args.passes, "rounds": args.rounds, "seed": args.seed,
                     "prompt_tokens": counts, "exact_max_tokens": [exact[i] for i in everything],
                     "mean_exact_blocks": mean_blocks, "budget_blocks": budget, "capacity": capacity,
                     "clients": clients, "offered_over_capacity": clients / capacity},
        "calibration": {config: {"clients": CALIBRATION_CLIENTS[config],
                                 "seconds": max(a.finished for a in answers) - min(a.sent for a in answers),
                                 "fallback_routes": sum(a.route is not None for a in answers)}
                        for config, answers in calibration.items()},
        "configs": configs,
    }


def table(report: dict) -> str:
    head = (f"{'guard':15} {'sent':>4} {'primary':>7} {'fallback':>8} {'TTFT p50':>9} {'p90':>7} {'p99':>7} "
            f"{'e2e p99':>8} {'tok/s':>6} {'preempt':>7} {'grown':>5} {'denied':>6} {'modes':>5} "
            f"{'degraded':>8} {'reserved':>8} {'used':>5} {'running':>7} {'load':>5}")
    rows = [head, "-" * len(head)]
    for config, result in report["configs"].items():
        for arm, p in result["arms"].items():
            ttft = p["ttft"]
            rows.append(
                f"{config + ' ' + arm:15} {p['requests']:>4} {p['served_by_primary']:>7} {p['fallback_routes']:>8} "
                f"{_ms(ttft['p50_ms']):>9} {_ms(ttft['p90_ms']):>7} {_ms(ttft['p99_ms']):>7} "
                f"{_ms(p['e2e']['p99_ms']):>8} {p['tokens_per_s']:>6.1f} {p['engine_preemptions']:>7} "
                f"{p['growths']['granted']:>5.0f} {p['growths']['denied']:>6.0f} {p['mode_transitions']:>5.0f} "
                f"{p['time_in_mode'].get('degraded', 0.0):>8.0%} {p['mean_reserved_blocks']:>8.1f} "
                f"{p['mean_used_blocks']:>5.1f} {p['mean_running']:>7.1f} {p['load_average_1m']:>5.1f}")
    return "\n".join(rows)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def print_report(report: dict) -> None:
    w = report["workload"]
    print(f"machine: {report['machine']}; load average at start {report['load_average_1m_at_start']:.2f}")
    print(f"command: {report['command']}")
    if report["quick"]:
        print("QUICK RUN: three short questions, not a measurement")
    print(f"workload: {w['prompts']} prompts x {w['passes']} pass(es) per guard and round, {w['rounds']} round(s); "
          f"exact requests average {w['mean_exact_blocks']:.1f} blocks; budget {w['budget_blocks']} blocks = "
          f"capacity {w['capacity']:.1f} requests; {w['clients']} clients ({w['offered_over_capacity']:.2f}x)")
    print(table(report))
    for config, result in report["configs"].items():
        v = result["verdicts"]
        ratio, share = v["p99_ttft_no_max_over_exact"], v["no_max_preemption_share"]
        print(f"{config}: p99 TTFT no_max / exact {'-' if ratio is None else f'{ratio:.2f}x'}; no_max engine "
              f"preemptions {'-' if share is None else f'{100 * share:.1f}%'} of its requests (goal <= "
              f"{100 * TARGET_PREEMPTION_SHARE:g}%: {'met' if v['no_max_preemptions_within_goal'] else 'NOT met'}); "
              f"fallback routes (goal 0) no_max {v['no_max_fallback_routes']}, exact {v['exact_fallback_routes']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-blocks", type=int, default=64, help="the engine's KV pool, in blocks of 16")
    parser.add_argument("--load", type=float, default=2.0, help="offered concurrency over the engine's capacity")
    parser.add_argument("--clients", type=int, default=None, help="closed-loop clients (default: --load x capacity)")
    parser.add_argument("--passes", type=int, default=1, help="times each prompt is sent per guard and round")
    parser.add_argument("--rounds", type=int, default=1, help="blocks per guard, the guards taking turns")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="three short questions, one round: checks that it runs")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "no_max_tokens.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.passes = 1, 1
    window = min(SMOLLM2_WINDOW, args.num_blocks * BLOCK_SIZE)  # no larger than the pool: the module docstring
    # fp32, as its figures were taken: the prompts are ones greedy fp32 SmolLM2 ends by itself, and 4-bit
    # weights (the default, auto) tip the bare France question into a loop that never emits EOS.
    args.engine_flags = ["--model", MODEL, "--device", "cpu", "--num-blocks", str(args.num_blocks),
                         "--block-size", str(BLOCK_SIZE), "--max-model-len", str(window), "--weight-format", "fp32"]
    started_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="no-max-tokens-") as workdir:
        result = asyncio.run(run(args, Path(workdir)))
    report = {"benchmark": "no_max_tokens", "quick": args.quick, "machine": describe(torch.device("cpu")),
              "command": command(), "load_average_1m_at_start": started_load, "engine_flags": args.engine_flags,
              **result}
    print_report(report)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_report(args.json, report)
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
