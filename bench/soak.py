"""The soak (issue 7): the whole stack for a while (10 minutes by default) under mixed tenants, attack bursts
and two engine restarts, then whether anything was lost. Run by hand, not in CI (a smoke test runs it for
15 seconds).

Processes, all real and on free loopback ports: the tiny engine (``python -m engine``; killed with SIGKILL
at 1/3 of the run and stopped with SIGTERM at 2/3, each time restarted on the same port at once) and the
guard (``python -m guard`` with a generated config whose last fallback is the static message).

Traffic, closed loops with think time; every request has a deadline of ``DEADLINE_S`` (one that passes it
is unanswered, i.e. lost); a refused request waits ``Retry-After`` (at most 5 s) before the next:

- acme (interactive, weight 2): 4 clients, streamed chat-sized completions;
- globex (agent): 2 clients, unary completions over a shared prefix (the prefix cache at work);
- bulk (batch): 2 clients, long unary completions;
- mallory (interactive): attack bursts of the Fill-and-Squeeze shape at 10%, 45% and 80% of the run:
  tiny probes, then 8 long ``ignore_eos`` generations (more blocks together than the guard commits) with
  more probes, then a squeeze of micro-requests.

Report: requests sent and answered (and the guard's own count of outcomes), the answers by status and
route, blocks leaked (the engine's blocks neither free nor cached once idle at the end), the
guard's reservations and queue at the end, its RSS after warm-up and at the end (from /proc VmRSS), and
latency p50/p99 per tenant over the answers the engine itself served.

    .venv/bin/python bench/soak.py [--minutes 10] [--report soak.json]

The exit status is 1 when something was lost (a request unanswered, a block leaked, a reservation left).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import torch
import yaml
from run_info import command, describe, write_report

REPO = Path(__file__).resolve().parent.parent
DEADLINE_S = 120.0
NUM_BLOCKS = 1024
TENANTS = [  # name, weight, lane
    ("acme", 2, "interactive"),
    ("globex", 1, "agent"),
    ("bulk", 1, "batch"),
    ("mallory", 1, "interactive"),
]
SHARED_PREFIX = "You are the agent of globex. Tools: search, fetch, summarize. Answer briefly. " * 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except OSError:
        return 0, b""


class Service:
    """One process of the stack, restartable on its port; its output goes to a log file."""

    def __init__(self, name: str, argv: list[str], url: str, log: Path) -> None:
        self.name, self.argv, self.url, self.log = name, argv, url, log
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 120.0) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while get(self.url + "/health")[0] != 200:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 60.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def metric_samples(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric in a Prometheus text page (labels as written, braces dropped)."""
    samples = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit(" ", 1)
            samples[labels.removesuffix("}")] = float(value)
    return samples


def metric_sum(text: str, name: str) -> float:
    return sum(metric_samples(text, name).values())


@dataclass(slots=True)
class Answer:
    tenant: str
    kind: str
    latency_s: float
    status: int
    route: str  # "primary" or the fallback's name
    whole: bool  # a JSON body, or a stream that ended with [DONE] or an error event


@dataclass(slots=True)
class Ledger:
    sent: int = 0
    answers: list[Answer] = field(default_factory=list)
    unanswered: Counter[str] = field(default_factory=Counter)  # why: exception name


class Load:
    """Every client of the run, sharing one ledger and one stop flag."""

    def __init__(self, guard_url: str, seed: int) -> None:
        self.url = guard_url + "/v1/completions"
        self.ledger = Ledger()
        self.stop = asyncio.Event()
        self.random = random.Random(seed)

    async def send(self, session: aiohttp.ClientSession, tenant: str, kind: str, body: dict) -> Answer | None:
        started = time.monotonic()
        self.ledger.sent += 1
        try:
            async with asyncio.timeout(DEADLINE_S), session.post(
                    self.url, json={"model": "tiny", "temperature": 0.8, **body},
                    headers={"Authorization": f"Bearer sk-{tenant}-soak"}) as response:
                payload = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.ledger.unanswered[type(exc).__name__] += 1
            return None
        if response.content_type == "text/event-stream":
            last = [event for event in payload.split(b"\n\n") if event][-1:]
            whole = last == [b"data: [DONE]"] or (last != [] and last[0].startswith(b"event: error"))
        else:
            whole = payload.startswith(b"{") and payload.rstrip().endswith(b"}")
        answer = Answer(tenant, kind, time.monotonic() - started, response.status,
                        response.headers.get("X-Guard-Route", "primary"), whole)
        self.ledger.answers.append(answer)
        if response.status != 200 and tenant != "mallory":  # the attacker never backs off
            await asyncio.sleep(min(5.0, float(response.headers.get("Retry-After", 1))))
        return answer

    async def client(self, tenant: str, kind: str, make_body: Callable[[], dict], think_s: tuple[float, float]
                     ) -> None:
        async with aiohttp.ClientSession() as session:
            while not self.stop.is_set():
                await self.send(session, tenant, kind, make_body())
                await asyncio.sleep(self.random.uniform(*think_s))

    def chat(self) -> dict:
        words = " ".join(self.random.choice(("kv", "cache", "block", "guard", "tenant", "token"))
                         for _ in range(self.random.randint(10, 60)))
        return {"prompt": f"User: {words}\nAssistant:", "max_tokens": self.random.randint(16, 96), "stream": True}

    def agent(self) -> dict:
        step = self.random.randint(0, 10**6)
        return {"prompt": f"{SHARED_PREFIX}Step {step}: call a tool.", "max_tokens": self.random.randint(8, 48)}

    def batch(self) -> dict:
        return {"prompt": "Summarize: " + "lorem ipsum " * self.random.randint(10, 40), "max_tokens": 256}

    async def attack(self, seconds: float) -> None:
        """One burst: probes, then long generations alongside the probes, then a squeeze of micro-requests."""
        probe = {"prompt": "p", "max_tokens": 1}
        long = {"prompt": "fill", "max_tokens": 1900, "ignore_eos": True, "stream": True}
        micro = {"prompt": "m", "max_tokens": 2}

        async def loop(body: dict, until: float, kind: str) -> None:
            async with aiohttp.ClientSession() as session:
                while time.monotonic() < until and not self.stop.is_set():
                    await self.send(session, "mallory", kind, body)
                    await asyncio.sleep(0.02)

        now = time.monotonic()
        await asyncio.gather(*(loop(probe, now + seconds / 3, "probe") for _ in range(4)))
        now = time.monotonic()
        await asyncio.gather(*(loop(long, now + seconds / 3, "long") for _ in range(8)),
                             *(loop(probe, now + seconds / 3, "probe") for _ in range(2)))
        now = time.monotonic()
        await asyncio.gather(*(loop(micro, now + seconds / 3, "micro") for _ in range(8)))


def guard_config(path: Path, port: int, engine_url: str) -> None:
    path.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": port},
        "engine": {"name": "primary", "url": engine_url},
        "fallbacks": [{"name": "static", "message": "The service is degraded; please retry shortly."}],
        "secret": "soak-secret",
        "limits": {"shutdown_timeout": 5},
        "tenants": [{"name": name, "api_keys": [f"sk-{name}-soak"], "weight": weight, "lane": lane,
                     "max_queue": 256} for name, weight, lane in TENANTS],
    }))


def tally(keys: Iterable[tuple]) -> dict[str, int]:
    return {" ".join(map(str, key)): n for key, n in sorted(Counter(keys).items())}


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def soak(minutes: float, workdir: Path, seed: int) -> dict:
    duration = minutes * 60
    engine_port, guard_port = free_port(), free_port()
    engine_url, guard_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{guard_port}"
    guard_config(workdir / "guard.yaml", guard_port, engine_url)
    engine = Service("engine", [sys.executable, "-m", "engine", "--model", "tiny", "--port", str(engine_port),
                                "--num-blocks", str(NUM_BLOCKS)], engine_url, workdir / "engine.log")
    guard = Service("guard", [sys.executable, "-m", "guard", "--config", str(workdir / "guard.yaml"),
                              "--log-level", "WARNING"], guard_url, workdir / "guard.log")
    await asyncio.to_thread(engine.start)
    try:
        await asyncio.to_thread(guard.start)
        assert guard.process is not None
        # Until its first telemetry the guard counts the engine as down, and leaves that mode after min_dwell_s.
        while json.loads(get(guard_url + "/health")[1]).get("mode") != "normal":
            await asyncio.sleep(0.1)
        load = Load(guard_url, seed)
        started = time.monotonic()
        clients = [asyncio.create_task(load.client("acme", "chat", load.chat, (0.2, 1.0))) for _ in range(4)]
        clients += [asyncio.create_task(load.client("globex", "agent", load.agent, (0.1, 0.5))) for _ in range(2)]
        clients += [asyncio.create_task(load.client("bulk", "batch", load.batch, (0.0, 0.2))) for _ in range(2)]

        async def at(fraction: float) -> None:
            await asyncio.sleep(max(0.0, started + fraction * duration - time.monotonic()))

        async def attacks() -> None:
            for fraction in (0.10, 0.45, 0.80):
                await at(fraction)
                await load.attack(min(15.0, duration / 6))

        async def restarts() -> list[dict]:
            downtime = []
            for fraction, sig in ((1 / 3, signal.SIGKILL), (2 / 3, signal.SIGTERM)):
                await at(fraction)
                stopped = time.monotonic()
                await asyncio.to_thread(engine.stop, sig)
                await asyncio.to_thread(engine.start)
                downtime.append({"signal": sig.name, "at_s": round(stopped - started, 1),
                                 "down_s": round(time.monotonic() - stopped, 1)})
            return downtime

        async def rss_samples() -> list[tuple[float, float]]:
            samples = []
            while not load.stop.is_set():
                samples.append((time.monotonic() - started, rss_mib(guard.process.pid)))
                await asyncio.sleep(1.0)
            return samples

        background = asyncio.gather(attacks(), restarts())
        sampler = asyncio.create_task(rss_samples())
        await at(1.0)
        _, downtime = await background  # a restart may end after the last minute: the run waits for it
        load.stop.set()
        await asyncio.gather(*clients)
        samples = await sampler

        deadline = time.monotonic() + 60
        while True:  # idle: nothing running or waiting in the engine
            snapshot = json.loads(get(engine_url + "/telemetry")[1])
            if snapshot["num_running"] + snapshot["num_waiting"] + snapshot["num_swapped"] == 0 \
                    or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        metrics = get(guard_url + "/metrics")[1].decode()
        warm_at = min(60.0, 0.1 * duration)
        warm = next((rss for at_s, rss in samples if at_s >= warm_at), samples[-1][1])
        end = rss_mib(guard.process.pid)
        return report(load.ledger, snapshot, metrics, downtime, warm, end, max(r for _, r in samples), minutes)
    finally:
        guard.stop()
        engine.stop()


def report(ledger: Ledger, snapshot: dict, metrics: str, downtime: list[dict], warm: float, end: float,
           peak: float, minutes: float) -> dict:
    latency: dict[str, dict] = {}
    for tenant, _, _ in TENANTS:
        served = [a.latency_s for a in ledger.answers if a.tenant == tenant and a.status == 200
                  and a.route == "primary"]
        if served:
            latency[tenant] = {"n": len(served), "p50_s": round(percentile(served, 50), 3),
                               "p99_s": round(percentile(served, 99), 3)}
    return {
        "minutes": minutes,
        "restarts": downtime,
        "sent": ledger.sent,
        "answered": len(ledger.answers),
        "unanswered": dict(ledger.unanswered),
        "whole": sum(a.whole for a in ledger.answers),
        "guard_outcomes": metric_sum(metrics, "guard_requests_total"),
        "statuses": tally((a.status, a.route) for a in ledger.answers),
        "by_tenant": tally((a.tenant, a.status) for a in ledger.answers),
        "attack": tally((a.kind, a.status) for a in ledger.answers if a.tenant == "mallory"),
        "engine_reclaimable_blocks": snapshot["free_blocks"] + snapshot["cached_blocks"],
        "engine_num_blocks": snapshot["num_blocks"],
        "leaked_blocks": snapshot["num_blocks"] - snapshot["free_blocks"] - snapshot["cached_blocks"],
        "guard_reserved_blocks": metric_sum(metrics, "guard_reserved_blocks"),
        "guard_queued": metric_sum(metrics, "guard_queue_depth"),
        "detections": {k: v for k, v in metric_samples(metrics, "guard_detections_total").items() if v},
        "mode_transitions": {k: v for k, v in metric_samples(metrics, "guard_mode_transitions_total").items() if v},
        "guard_rss_mib": {"warm": round(warm, 1), "end": round(end, 1), "peak": round(peak, 1),
                          "growth": round(end / warm - 1, 4)},
        "latency": latency,
    }


def lost(result: dict) -> list[str]:
    problems = []
    if result["answered"] != result["sent"] or result["whole"] != result["answered"]:
        problems.append("requests unanswered or cut short")
    if result["guard_outcomes"] != result["sent"]:
        problems.append("the guard's outcomes do not match the requests sent")
    if result["leaked_blocks"] or result["guard_reserved_blocks"] or result["guard_queued"]:
        problems.append("blocks, reservations or queue entries left behind")
    return problems


def print_report(result: dict) -> None:
    rss = result["guard_rss_mib"]
    print(f"duration: {result['minutes']:g} min; engine restarts: " + ", ".join(
        f"{r['signal']} at {r['at_s']:g} s (back after {r['down_s']:g} s)" for r in result["restarts"]))
    print(f"requests: {result['sent']} sent, {result['answered']} answered ({result['whole']} whole), "
          f"unanswered {result['unanswered'] or 0}; the guard counted {result['guard_outcomes']:.0f} outcomes")
    print("answers by status and route: " + ", ".join(f"{k}: {v}" for k, v in result["statuses"].items()))
    print("answers by tenant and status: " + ", ".join(f"{k}: {v}" for k, v in result["by_tenant"].items()))
    print("the attacker's answers by kind and status: " + ", ".join(f"{k}: {v}" for k, v in result["attack"].items()))
    print("detections: " + (", ".join(f"{{{k}}}: {v:.0f}" for k, v in result["detections"].items()) or "none")
          + "; mode transitions: " + ", ".join(f"{{{k}}}: {v:.0f}" for k, v in result["mode_transitions"].items()))
    print(f"leaked blocks: {result['leaked_blocks']} (free or cached {result['engine_reclaimable_blocks']} of "
          f"{result['engine_num_blocks']} once idle); guard reservations at the end: "
          f"{result['guard_reserved_blocks']:.0f} blocks, queued {result['guard_queued']:.0f}")
    print(f"guard RSS: {rss['warm']} MiB after warm-up, {rss['end']} MiB at the end ({rss['growth']:+.1%}), "
          f"peak {rss['peak']} MiB")
    print("latency of answers the engine served: " + "; ".join(
        f"{tenant} p50 {v['p50_s']:.2f} s, p99 {v['p99_s']:.2f} s (n={v['n']})"
        for tenant, v in result["latency"].items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--report", type=Path, help="also write the figures here as JSON")
    parser.add_argument("--logs", type=Path, help="keep the engine's and the guard's logs in this directory")
    args = parser.parse_args()
    print(f"machine: {describe(torch.device('cpu'))}")
    print(f"command: {command()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvguard-soak-") as workdir:
        logs = args.logs or Path(workdir)
        logs.mkdir(parents=True, exist_ok=True)
        result = asyncio.run(soak(args.minutes, logs, args.seed))
    print_report(result)
    if args.report is not None:
        write_report(args.report, result)
    problems = lost(result)
    for problem in problems:
        print(f"LOST: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
