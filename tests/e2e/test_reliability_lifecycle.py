"""Reliability, processes coming and going (issue 7, cases 13 to 15): the engine restarted twice under load,
SIGTERM to a guard process with 50 streams running and more queued, and configurations the guard must refuse
to start with. Engines and guards that get killed or signalled are real processes (support.processes)."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.engine_server import ServerThread
from support.guard_server import guard_config
from support.net import free_port, request
from support.nothing_lost import (
    Answer,
    Client,
    Tally,
    assert_nothing_lost,
    assert_openai_error,
    assert_stream_failed,
    ready_guard,
)
from support.processes import Processes, run_command
from support.wait import until

ROUTING = {"min_dwell_s": 1.0, "cooldown_s": 0.5, "health_interval_s": 0.2, "failure_threshold": 2}


def ended_properly(answer: Answer) -> bool:
    """A whole answer: a complete stream, a stream ended by an error event, or a JSON body."""
    if answer.headers.get("Content-Type", "").startswith("text/event-stream"):
        events = answer.events()
        return events[-1] == b"data: [DONE]" or events[-1].startswith(b"event: error\n")
    return isinstance(answer.json(), dict)


# Slow (16 s of the suite's 15-minute budget) for what faster tests hold too: a SIGKILLed engine restarted
# under load and the guard serving from it again (tests/guard/test_guard_routing.py and
# tests/guard/test_pool_routing.py), an engine SIGTERMed under load and restarted
# (tests/e2e/test_rolling_restart.py); make test-slow runs it.
@pytest.mark.slow
async def test_13_engine_restarted_twice_under_load_hangs_nothing_and_the_guard_recovers_alone(
        processes: Processes) -> None:
    """Six clients in closed loops while the engine is killed (SIGKILL), restarted, stopped (SIGTERM) and
    restarted: every request ends within its deadline with an answer, and after each restart the guard goes
    back to serving from the engine without anyone touching it."""
    tally = Tally()
    answers: list[tuple[float, Answer]] = []
    engine = processes.engine("--num-blocks", "512")
    config = guard_config(engine.url, routing=ROUTING, admission={"telemetry_stale_s": 1.0})
    async with ready_guard(config, timeout=10) as guard:
        stop = asyncio.Event()

        async def closed_loop(key: str, stream: bool) -> None:
            client = Client(guard.url, tally, key=key)
            while not stop.is_set():
                body = {"model": "tiny", "prompt": f"restart {key}", "max_tokens": 96, "ignore_eos": True,
                        "stream": stream}
                answer = await asyncio.wait_for(client.call(body), 30)  # a hung request fails the test
                answers.append((time.monotonic(), answer))
                if answer.status != 200:
                    await asyncio.sleep(0.1)  # as a client honouring a short Retry-After would

        clients = [asyncio.create_task(closed_loop(key, stream))
                   for key in ("sk-acme", "sk-globex", "sk-bulk") for stream in (True, False)]
        recovered_at = []
        for sig in (signal.SIGKILL, signal.SIGTERM):
            await asyncio.sleep(2)
            code = await asyncio.to_thread(engine.stop, sig)
            assert sig is signal.SIGKILL or code == 0, f"no clean exit on {sig.name}:\n{engine.log_tail()}"
            await asyncio.to_thread(engine.start)
            await until(lambda: guard.call(lambda: guard.state.modes.mode == "normal"
                                           and guard.state.pool.any_up()), bool, 20)
            recovered_at.append(time.monotonic())
        await asyncio.sleep(2)
        stop.set()
        await asyncio.gather(*clients)

        print("answers by status:", Counter(answer.status for _, answer in answers))
        for _, answer in answers:
            assert answer.status in (200, 502, 503, 504), answer
            assert ended_properly(answer), answer.body[-300:]
            if answer.status != 200:
                assert_openai_error(answer, answer.status)
        for since in recovered_at:
            served = [a for at, a in answers if at > since and a.status == 200 and "X-Guard-Route" not in a.headers
                      and ended_properly(a) and b"event: error" not in a.body]
            assert served, "the engine served again after its restart"
        await assert_nothing_lost(guard, tally, [engine])


@pytest.fixture
def sigterm_engine() -> Any:
    with ServerThread(num_blocks=2048, max_num_seqs=64) as server:
        yield server


async def test_14_sigterm_with_50_streams_closes_the_listener_ends_streams_and_refuses_the_queue(
        tmp_path: Path, sigterm_engine: ServerThread, processes: Processes) -> None:
    """50 streams run (bulk's first among them) and bulk has 5 more requests queued behind its block cap
    when the guard gets SIGTERM: the listener closes at once, the queued requests get 503, each stream
    finishes within the shutdown timeout or ends with an error event, the guard exits, and the engine is
    left with no request and every block free (no connection left open behind)."""
    shutdown_timeout = 3.0
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tenants = [{"name": "acme", "api_keys": ["sk-acme"], "weight": 2},
               {"name": "bulk", "api_keys": ["sk-bulk"], "lane": "batch", "max_blocks_share": 0.01}]
    guard_config(sigterm_engine.url, tmp_path, listen={"host": "127.0.0.1", "port": port}, tenants=tenants,
                 limits={"shutdown_timeout": shutdown_timeout})
    guard = processes.guard(tmp_path / "guard.yaml")
    tally = Tally()
    client = Client(url, tally)
    body = {"model": "tiny", "prompt": "x" * 15, "max_tokens": 400, "ignore_eos": True, "stream": True}
    started = [asyncio.Event() for _ in range(50)]
    # Half are short enough to end within the shutdown timeout (50 streams decode ~10 tokens/s each on
    # two shared cores), half are not.
    # Bulk's is a long one: while it holds bulk's block cap, bulk's 5 later requests stay queued (a short one
    # could end before they are counted, and one of them would be admitted).
    streams = [asyncio.create_task(client.call({**body, "max_tokens": 400 if i % 2 else 20},
                                               key="sk-bulk" if i == 1 else "sk-acme", started=event))
               for i, event in enumerate(started)]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 30)
    queued = [asyncio.create_task(client.call(body, key="sk-bulk")) for _ in range(5)]
    await until(lambda: queue_depth(url, "bulk"), lambda n: n == 5, 5)

    guard.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    await until(lambda: refuses_connections(port), bool, 1)
    assert not all(stream.done() for stream in streams), "the listener closed while streams still ran"
    for answer in await asyncio.wait_for(asyncio.gather(*queued), 1):
        assert_openai_error(answer, 503, "shutting_down")
    answers = await asyncio.wait_for(asyncio.gather(*streams), shutdown_timeout + 5)
    finished = sum(a.events()[-1] == b"data: [DONE]" for a in answers)
    for answer in answers:
        if answer.events()[-1] != b"data: [DONE]":
            assert assert_stream_failed(answer)["code"] == "shutting_down"
    assert guard.wait(shutdown_timeout + 5) == 0, guard.log_text()[-2000:]
    print(f"{finished} of 50 streams finished, the others ended with an error event; exit after "
          f"{time.monotonic() - signalled:.2f} s")
    await assert_nothing_lost(None, tally, [sigterm_engine])


async def test_16_sigterm_with_a_drain_delay_answers_503_draining_and_serves_until_the_delay_ends(
        tmp_path: Path, sigterm_engine: ServerThread, processes: Processes) -> None:
    """``--drain-delay``: SIGTERM turns /health 503 draining at once, a stream running then and requests sent
    during the delay are served whole, the listener closes when the delay ends, the guard exits 0. A second
    SIGTERM (on a guard restarted with a long delay) skips what is left of it."""
    delay = 3.0
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    guard_config(sigterm_engine.url, tmp_path, listen={"host": "127.0.0.1", "port": port})
    guard = processes.guard(tmp_path / "guard.yaml", "--drain-delay", str(delay))
    client = Client(url, Tally())
    body = {"model": "tiny", "prompt": "drain", "max_tokens": 48, "ignore_eos": True, "stream": True}
    started = asyncio.Event()
    running = asyncio.create_task(client.call(body, started=started))
    await asyncio.wait_for(started.wait(), 30)

    guard.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    _, raw = await until(lambda: request(url + "/health"), lambda answer: answer[0] == 503, 1)
    assert yaml.safe_load(raw)["status"] == "draining", raw
    during = await client.call({**body, "stream": False})  # sent after /health said draining: still served
    assert during.status == 200 and during.json()["usage"]["completion_tokens"] == 48, during
    answer = await running
    assert answer.status == 200 and answer.events()[-1] == b"data: [DONE]", answer.body[-300:]
    await until(lambda: refuses_connections(port), bool, delay + 5)
    assert time.monotonic() - signalled >= delay - 0.1  # not before the delay ended
    assert guard.wait(15) == 0, guard.log_tail()

    guard.command[guard.command.index("--drain-delay") + 1] = "600"
    guard.start()
    guard.send_signal(signal.SIGTERM)
    await until(lambda: request(url + "/health")[0], lambda status: status == 503, 5)
    guard.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(guard.wait, 15) == 0, guard.log_tail()


def queue_depth(url: str, tenant: str) -> float:
    for line in request(url + "/metrics")[1].decode().splitlines():
        if line.startswith(f'guard_queue_depth{{tenant="{tenant}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def refuses_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except ConnectionRefusedError:
        return True
    return False


VALID = {"engine": {"url": "http://127.0.0.1:8100"}, "secret": "test-secret",
         "tenants": [{"name": "acme", "api_keys": ["sk-a"]}]}
INVALID_CONFIGS = {
    "unknown key": (yaml.safe_dump({**VALID, "admission": {"safe_utilisation": 0.8}}),
                    "admission.safe_utilisation: unknown key 'safe_utilisation'"),
    "bad type": (yaml.safe_dump({**VALID, "tenants": [{"name": "acme", "api_keys": ["sk-a"], "weight": "heavy"}]}),
                 "tenants.0.weight: Input should be a valid number"),
    "duplicate key": (yaml.safe_dump(VALID) + "engine: {url: 'http://127.0.0.1:9'}\n", "duplicate key 'engine'"),
    "duplicate tenant": (yaml.safe_dump({**VALID, "tenants": [{"name": "acme", "api_keys": ["sk-a"]},
                                                              {"name": "acme", "api_keys": ["sk-b"]}]}),
                         "duplicate tenant name(s): acme"),
}


async def test_15_invalid_config_refuses_to_start_naming_the_problem(tmp_path: Path) -> None:
    async def start(name: str, text: str) -> tuple[int, str]:
        path = tmp_path / f"{name.replace(' ', '_')}.yaml"
        path.write_text(text)
        done = await asyncio.to_thread(run_command, sys.executable, "-m", "guard", "--config", path, timeout=30)
        return done.returncode, done.stderr

    results = await asyncio.gather(*(start(name, text) for name, (text, _) in INVALID_CONFIGS.items()))
    for (name, (_, problem)), (code, err) in zip(INVALID_CONFIGS.items(), results, strict=True):
        assert code == 2, (name, err)
        assert err.startswith("guard: invalid configuration: ") and problem in err, (name, err)
        assert "Traceback" not in err, err

