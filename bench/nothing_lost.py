"""Nothing lost (issue 42) in figures: three tiny engine replicas behind one guard (one of them in a network
namespace of its own, so that its link can be cut), 24 streaming chats and 8 unary ones in flight, then one
fault, then the replica restored; the faults in turn on the same pool:

- ``kill``: SIGKILL of the replica serving the most requests (restarted after);
- ``stop``: SIGSTOP of the busiest (silent: no reset, no telemetry; SIGCONT after);
- ``cut``: the namespaced replica's link set down (silent too; set up after);
- ``drain``: SIGTERM of the busiest, started with ``--drain-timeout 1`` (restarted after).

Per fault: answers complete (status 200, a stream through ``[DONE]``) of 32; stream texts equal to the
uninterrupted greedy answer (an engine asked directly) of 24; moves by reason (``guard_migrations_total``);
for ``stop`` and ``cut``, seconds from the fault to the guard's first move (the silence deadline is the
guard's default, ``migration.silence_floor_s`` 3 s); and whether a request sent right after is served. A
drained replica that finishes what it runs within its drain timeout hands nothing back: its row then says
no move (``seconds_to_first_move`` None), as it should, where the bench used to fail waiting for one (one
run in two at 0b4103f and at 44c43e7 alike, when the busiest replica had less left than a second's work).
Needs root (``ip netns``).

    .venv/bin/python bench/nothing_lost.py [--report bench/results/nothing_lost.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the tests' process, guard and namespace helpers

from support.guard_server import GuardThread, guard_config
from support.net import request
from support.netns import Netns
from support.nothing_lost import ready_guard
from support.processes import EngineProcess, Process
from support.wait import until

from bench.run_info import command, describe, write_report

MAX_TOKENS = 160
STREAMS, UNARY = 24, 8


def body(i: int, stream: bool) -> dict[str, Any]:
    return {"model": "tiny", "temperature": 0.0, "ignore_eos": True, "stream": stream, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": f"nothing lost {i}"}]}


async def call(session: aiohttp.ClientSession, url: str, payload: dict[str, Any], started: asyncio.Event | None,
               key: str = "sk-acme") -> tuple[int, str, bool]:
    """(status, text, whole) of one chat: a stream's text from its deltas, whole when it ended with [DONE]."""
    async with session.post(url + "/v1/chat/completions", json=payload,
                            headers={"Authorization": f"Bearer {key}"}) as response:
        if started is not None:
            started.set()
        raw = await response.read()
    if response.status != 200:
        return response.status, "", False
    if not payload["stream"]:
        return 200, json.loads(raw)["choices"][0]["message"]["content"], True
    text = ""
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {"):
            data = json.loads(event[6:])
            text += "".join((c.get("delta") or {}).get("content") or "" for c in data.get("choices", []))
    return 200, text, raw.endswith(b"data: [DONE]\n\n")


def moves(guard: GuardThread) -> dict[str, float]:
    _, raw = request(guard.url + "/metrics")
    return {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in raw.decode().splitlines() if line.startswith("guard_migrations_total{")}


async def one_fault(guard: GuardThread, fault, expected: list[str], offset: int) -> dict[str, Any]:
    """32 requests in flight, ``fault()`` once every stream has begun; the figures of the row."""
    before = moves(guard)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        started = [asyncio.Event() for _ in range(STREAMS)]
        calls = [asyncio.create_task(call(session, guard.url, body(offset + i, i < STREAMS),
                                          started[i] if i < STREAMS else None))
                 for i in range(STREAMS + UNARY)]
        await asyncio.gather(*(event.wait() for event in started))
        await asyncio.sleep(0.3)
        faulted = time.monotonic()
        await fault()
        moved = asyncio.create_task(until(lambda: sum(moves(guard).values()) > sum(before.values())
                                          and time.monotonic(), bool, 30, interval=0.02))
        answers = await asyncio.wait_for(asyncio.gather(*calls), 120)
        # Every answer is in: a move would have come by now, or none was needed (all ended in time).
        first_move = await moved if sum(moves(guard).values()) > sum(before.values()) else None
        moved.cancel()
        await asyncio.gather(moved, return_exceptions=True)  # its wait for a move that never came, ended
        after = await call(session, guard.url, body(999, True), None)
    now = moves(guard)
    return {"complete": sum(status == 200 and whole for status, _, whole in answers),
            "stream_texts_equal": sum(text == expected[i] for i, (_, text, _) in enumerate(answers[:STREAMS])),
            "moves": {k: now[k] - before.get(k, 0) for k in now if now[k] > before.get(k, 0)},
            "seconds_to_first_move": None if first_move is None else round(first_move - faulted, 2),
            "served_after": after[0] == 200 and after[2]}


async def reference(engine_url: str, offset: int) -> list[str]:
    async with aiohttp.ClientSession() as session:
        return [text for _, text, _ in await asyncio.gather(*(
            call(session, engine_url, body(offset + i, True), None) for i in range(STREAMS)))]


async def run(root: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with Netns(3) as ns:
        far = Process("far", ns.exec([sys.executable, "-m", "engine", "--model", "tiny", "--host", ns.address,
                                      "--port", "8100", "--num-blocks", "512", "--drain-timeout", "1"]),
                      ready_url=f"http://{ns.address}:8100/health", log=root / "far.log")
        near = [EngineProcess("--num-blocks", "512", "--drain-timeout", "1", name=f"e{i}", log=root / f"e{i}.log")
                for i in (1, 2)]
        engines: list[Process] = [far, *near]
        for engine in engines:
            engine.spawn()
        try:
            for engine in engines:
                engine.wait_ready()
            urls = [f"http://{ns.address}:8100", *(engine.url for engine in near)]
            by_name = dict(zip(("e0", "e1", "e2"), engines, strict=True))
            config = guard_config(urls, routing={"cooldown_s": 1.0, "health_interval_s": 0.2, "failure_threshold": 2})
            async with ready_guard(config, timeout=20) as guard:
                rows = await faults(guard, by_name, ns, near[0].url)
        finally:
            for engine in engines:
                engine.close()
    return rows


async def faults(guard: GuardThread, by_name: dict[str, Process], ns: Netns, reference_url: str) -> list[dict]:
    def busiest() -> str:
        return guard.call(lambda: max(guard.state.pool, key=lambda r: r.in_flight).name)

    async def restored() -> None:
        await until(lambda: guard.call(lambda: all(r.up() and r.breaker.closed for r in guard.state.pool)),
                    bool, 60, interval=0.1)

    hit: list[str] = []
    plan = {"kill": (lambda n: by_name[n].kill(), lambda n: by_name[n].start()),
            "stop": (lambda n: by_name[n].send_signal(signal.SIGSTOP), lambda n: by_name[n].send_signal(signal.SIGCONT)),
            "cut": (lambda n: ns.cut(), lambda n: ns.mend()),
            "drain": (lambda n: by_name[n].send_signal(signal.SIGTERM), lambda n: (by_name[n].wait(30), by_name[n].start()))}
    rows = []
    for index, (name, (do, undo)) in enumerate(plan.items()):
        offset = 100 * index
        expected = await reference(reference_url, offset)

        async def fault(do=do, name=name) -> None:
            hit[:] = ["e0" if name == "cut" else busiest()]  # the namespaced replica's link is the one to cut
            do(hit[0])

        row = {"fault": name, **await one_fault(guard, fault, expected, offset)}
        row["replica"] = hit[0]
        await asyncio.to_thread(undo, hit[0])
        await restored()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()
    print(f"machine: {describe(torch.device('cpu'))}")
    print(f"command: {command()}")
    with tempfile.TemporaryDirectory() as root:
        rows = asyncio.run(run(Path(root)))
    if args.report is not None:
        write_report(args.report, {"machine": describe(torch.device("cpu")), "command": command(), "rows": rows})


if __name__ == "__main__":
    main()
