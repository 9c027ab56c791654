"""What the telemetry stream costs the engine: generated tokens/s with and without a subscriber.

One engine process (``python -m engine``) runs under a steady closed-loop load for the whole run; rounds of
equal length alternate between no subscriber and ``/telemetry/stream`` subscribers that parse every
snapshot as the guard does: first one subscriber (the guard's case), then several, which multiplies the
cost so that it can stand out of a shared machine's noise. The order is ABBA (off, on, on, off, ...) so a
slow drift of the machine hits both sides alike. Per round:

- throughput: the engine's own ``generation_tokens_total`` delta over the round's wall time (read from
  ``/telemetry`` at the round's edges); overhead = 1 - with / without, as medians and per ABBA block;
- CPU of the engine process (from /proc, per thread): its event-loop thread (HTTP, SSE writes) in ms per
  second, and its other threads (the step loop) in ms per 1000 generated tokens. The event loop's extra
  CPU with a subscriber is the stream's own cost, measured directly rather than through throughput.

    .venv/bin/python bench/telemetry_overhead.py [--rounds 16] [--round-seconds 3] [--amplify 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import torch
from run_info import command, describe

from engine.protocol import TelemetrySnapshot

REPO = Path(__file__).resolve().parent.parent


@dataclass(slots=True)
class Round:
    subscribers: int
    tokens_per_s: float
    loop_cpu_ms_per_s: float
    step_cpu_ms_per_1k_tokens: float
    snapshots_per_s: float


def thread_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of the process's main thread, and of all its other threads."""
    main = others = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # a short-lived helper thread that just ended
            continue
        seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        if int(tid) == pid:
            main += seconds
        else:
            others += seconds
    return main, others


async def start_engine(engine_flags: list[str]) -> tuple[asyncio.subprocess.Process, str]:
    command = [sys.executable, "-m", "engine", "--port", "0", *engine_flags]
    print("engine:", shlex.join(command), flush=True)
    process = await asyncio.create_subprocess_exec(*command, cwd=REPO, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.STDOUT)
    assert process.stdout is not None
    url = ""
    while True:
        line = (await process.stdout.readline()).decode()
        if not line:
            raise RuntimeError("the engine exited before it was ready")
        if line.startswith("engine: listening on "):
            url = line.split()[3]
        if line.startswith("engine: ready"):
            return process, url


async def worker(session: aiohttp.ClientSession, url: str, index: int, max_tokens: int) -> None:
    """Closed loop: one request at a time, forever (prompts differ so the prefix cache stays out of it)."""
    for serial in range(sys.maxsize):
        body = {"model": "tiny", "prompt": f"worker {index} request {serial}: ", "max_tokens": max_tokens,
                "ignore_eos": True, "temperature": 0.0}
        async with session.post(url + "/v1/completions", json=body) as answer:
            await answer.read()


async def subscriber(session: aiohttp.ClientSession, url: str, received: list[int]) -> None:
    async with session.get(url + "/telemetry/stream") as stream:
        async for line in stream.content:
            if line.startswith(b"data:"):
                TelemetrySnapshot.model_validate_json(line[5:])
                received[0] += 1


async def generated(session: aiohttp.ClientSession, url: str) -> int:
    async with session.get(url + "/telemetry") as answer:
        return TelemetrySnapshot.model_validate_json(await answer.read()).generation_tokens_total


async def measure(session: aiohttp.ClientSession, url: str, pid: int, subscribers: int, seconds: float) -> Round:
    received = [0]
    tasks = [asyncio.create_task(subscriber(session, url, received)) for _ in range(subscribers)]
    await asyncio.sleep(0.2)  # let the subscriptions settle before the round starts
    tokens, started, (loop_cpu, step_cpu) = await generated(session, url), time.perf_counter(), thread_cpu(pid)
    first_snapshots = received[0]
    await asyncio.sleep(seconds)
    tokens, elapsed = await generated(session, url) - tokens, time.perf_counter() - started
    loop_end, step_end = thread_cpu(pid)
    snapshots = received[0] - first_snapshots
    for task in tasks:
        task.cancel()
    return Round(subscribers, tokens / elapsed, 1e3 * (loop_end - loop_cpu) / elapsed,
                 1e6 * (step_end - step_cpu) / tokens, snapshots / elapsed)


async def phase(session: aiohttp.ClientSession, url: str, pid: int, subscribers: int, rounds: int,
                seconds: float) -> list[Round]:
    results = []
    for i in range(rounds):
        on = i % 4 in (1, 2)  # ABBA: off, on, on, off, ...
        result = await measure(session, url, pid, subscribers if on else 0, seconds)
        results.append(result)
        print(f"  round {i + 1:2d} {result.subscribers:2d} subscribers {result.tokens_per_s:7.1f} tokens/s, "
              f"event loop {result.loop_cpu_ms_per_s:5.1f} CPU ms/s, steps {result.step_cpu_ms_per_1k_tokens:5.0f} "
              f"CPU ms/1k tokens, {result.snapshots_per_s:5.1f} snapshots/s", flush=True)
    return results


def summary(label: str, rounds: list[Round]) -> str:
    def median(subscribed: bool, value: str) -> float:
        return statistics.median(getattr(r, value) for r in rounds if bool(r.subscribers) == subscribed)

    off, on = median(False, "tokens_per_s"), median(True, "tokens_per_s")
    # Each ABBA block compares neighbours, which cancels the machine's slow drift.
    blocks = [rounds[i : i + 4] for i in range(0, len(rounds) - 3, 4)]
    paired = sorted(1 - statistics.mean(r.tokens_per_s for r in b if r.subscribers)
                    / statistics.mean(r.tokens_per_s for r in b if not r.subscribers) for b in blocks)
    spread = statistics.pstdev(r.tokens_per_s for r in rounds if not r.subscribers) / off
    loop_off, loop_on = median(False, "loop_cpu_ms_per_s"), median(True, "loop_cpu_ms_per_s")
    step_off, step_on = median(False, "step_cpu_ms_per_1k_tokens"), median(True, "step_cpu_ms_per_1k_tokens")
    return (f"{label} ({median(True, 'snapshots_per_s'):.1f} snapshots/s):\n"
            f"  tokens/s {off:.0f} without, {on:.0f} with: overhead {100 * (1 - on / off):+.1f}% (medians), "
            f"{100 * statistics.median(paired):+.1f}% (median of {len(blocks)} ABBA blocks, from "
            f"{100 * paired[0]:+.1f}% to {100 * paired[-1]:+.1f}%); rounds without a subscriber spread "
            f"{100 * spread:.0f}%\n"
            f"  event-loop CPU {loop_off:.1f} ms/s without, {loop_on:.1f} ms/s with: the stream costs "
            f"{loop_on - loop_off:+.1f} ms per second ({(loop_on - loop_off) / 10:+.2f}% of a core)\n"
            f"  step-loop CPU {step_off:.0f} ms per 1000 tokens without, {step_on:.0f} with "
            f"({100 * (step_on / step_off - 1):+.1f}%)")


async def run(args: argparse.Namespace) -> None:
    engine_flags = ["--model", "tiny", "--device", "cpu", "--num-blocks", str(args.num_blocks),
                    "--cpu-threads", str(args.cpu_threads)]
    print("machine:", describe(torch.device("cpu")))
    print("command:", command())
    process, url = await start_engine(engine_flags)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            workers = [asyncio.create_task(worker(session, url, i, args.max_tokens)) for i in range(args.concurrency)]
            await measure(session, url, process.pid, 0, args.round_seconds)  # warm-up, not counted
            print("one subscriber (what the guard does):")
            single = await phase(session, url, process.pid, 1, args.rounds, args.round_seconds)
            print(f"{args.amplify} subscribers (the cost multiplied):")
            amplified = await phase(session, url, process.pid, args.amplify, args.rounds, args.round_seconds)
            for task in workers:
                task.cancel()
    finally:
        process.terminate()
        await process.wait()
    print(summary("1 subscriber", single))
    print(summary(f"{args.amplify} subscribers", amplified))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=16, help="rounds per phase, half of them subscribed")
    parser.add_argument("--round-seconds", type=float, default=3.0)
    parser.add_argument("--amplify", type=int, default=8, help="subscribers in the second phase")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight, closed loop")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--cpu-threads", type=int, default=1, help="the engine's --cpu-threads")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
