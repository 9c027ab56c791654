"""Hostile connections (issue 16): the guard's deadlines for a request's headers and body, its idle keep-alive
timeout and its connection cap (guard/wire/connections.py).

The acceptance case runs on the default settings: 1,500 slowloris connections that dribble header lines and
one request whose ``Content-Length`` lies are all cut (the slowloris at the 10 s header deadline, the lie at
the 20 s body deadline), while completions through the same guard stay under a second. The finer cases run
with deadlines of a second or two. Raw sockets play the hostile clients: no HTTP client library sends half
a request on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from support.engine_server import ServerThread
from support.fault_upstream import FaultUpstream
from support.guard_server import GuardThread, guard_config
from support.net import free_port, request
from support.nothing_lost import ready_guard
from support.processes import Processes
from support.wait import until

from guard.config import Connections
from guard.wire.connections import MAX_CONNECTIONS_CEILING, default_max_connections

SLOWLORIS = 1500
DRIBBLE_S = 2.0  # between two header lines of a slowloris connection
COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
SHORT = {"header_timeout_s": 1.0, "body_timeout_s": 1.0, "keepalive_timeout_s": 2.0}


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerThread]:
    with ServerThread(num_blocks=256) as server:
        yield server


@contextlib.asynccontextmanager
async def guard_with(engine_url: str, **connections: Any) -> AsyncIterator[GuardThread]:
    async with ready_guard(guard_config(engine_url, connections=connections)) as guard:
        yield guard


def cuts(guard: GuardThread) -> dict[str, float]:
    """``guard_connections_cut_total`` by reason, read on the guard's loop."""
    counter = guard.state.metrics.connections_cut
    return guard.call(lambda: {s.labels["reason"]: s.value for m in counter.collect() for s in m.samples
                               if s.name.endswith("_total")})


def gauge(guard: GuardThread, name: str) -> float:
    """A gauge of the guard's without labels, as scraped (``guard_connections_open`` is computed)."""
    return guard.call(lambda: next(s.value for m in guard.state.metrics.registry.collect() if m.name == name
                                   for s in m.samples))


def open_connections(guard: GuardThread) -> float:
    return gauge(guard, "guard_connections_open")


async def connect(guard_url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = guard_url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def until_closed(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """Everything the guard sends until it closes the connection (a reset ends it too)."""
    with contextlib.suppress(ConnectionResetError):
        return await asyncio.wait_for(reader.read(), timeout)
    return b""


async def timed_until_closed(reader: asyncio.StreamReader, since: float, timeout: float) -> tuple[float, bytes]:
    """``until_closed``, and how long after ``since`` (a ``time.monotonic()``) the connection closed."""
    answer = await until_closed(reader, timeout)
    return time.monotonic() - since, answer


def status(answer: bytes) -> int | None:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None


def json_body(answer: bytes) -> dict[str, Any]:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])


def completion_head(content_length: int, key: str = "sk-acme") -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: guard\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {content_length}\r\n\r\n").encode()


def ensure_descriptors(needed: int) -> None:
    """Raise this process's soft descriptor limit to ``needed`` (skip the test if the hard limit is lower)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"needs {needed} descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


async def slowloris(guard_url: str) -> tuple[float, bytes]:
    """A connection that sends a request line and then one header line every ``DRIBBLE_S``: how long it
    stayed open (from before its connect, so never less than the guard saw), and what the guard sent before
    closing it."""
    opened = time.monotonic()
    reader, writer = await connect(guard_url)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: guard\r\n")

    async def dribble() -> None:
        with contextlib.suppress(ConnectionError):
            for line in range(1000):
                await asyncio.sleep(DRIBBLE_S)
                writer.write(f"X-Line-{line}: still here\r\n".encode())
                await writer.drain()

    dribbling = asyncio.create_task(dribble())
    try:
        answer = await until_closed(reader, 90)
        return time.monotonic() - opened, answer
    finally:
        dribbling.cancel()
        writer.close()


async def test_defaults_cut_1500_slowloris_and_a_lying_body_while_completions_stay_fast(
        engine: ServerThread) -> None:
    """The issue's acceptance, on the default settings: 1,500 slowloris connections are all closed within a
    minute (at the 10 s header deadline, whatever they dribble), a request whose headers promise 5,000 bytes
    and whose body stops after 9 is answered 408 and closed within 30 s, and completions sent all along
    through the same guard each take under a second."""
    ensure_descriptors(2 * SLOWLORIS + 1024)  # both ends of every connection live in this process
    defaults = Connections()
    async with ready_guard(guard_config(engine.url)) as guard, aiohttp.ClientSession() as session:
        auth = {"Authorization": "Bearer sk-acme"}

        async def complete() -> float:
            began = time.monotonic()
            async with session.post(guard.url + "/v1/completions", json=COMPLETION, headers=auth) as response:
                assert response.status == 200, await response.text()
                await response.read()
            return time.monotonic() - began

        await complete()  # the tokenizer and the engine's first step, once
        reader, writer = await connect(guard.url)
        writer.write(completion_head(5000) + b'{"model":')  # 9 of the 5,000 bytes, then silence
        lied = time.monotonic()
        lie = asyncio.create_task(until_closed(reader, 60))
        attack: list[asyncio.Task[tuple[float, bytes]]] = []
        for _ in range(SLOWLORIS // 100):  # 100 at a time: the listen backlog is 128
            batch = [asyncio.create_task(slowloris(guard.url)) for _ in range(100)]
            attack += batch
            await asyncio.sleep(0.05)
        latencies = []
        while not (lie.done() and all(task.done() for task in attack)):
            latencies.append(await complete())
            await asyncio.sleep(0.2)
        lie_answer, lie_s = lie.result(), time.monotonic() - lied
        writer.close()
        results = [task.result() for task in attack]

        lifetimes = sorted(lifetime for lifetime, _ in results)
        assert lifetimes[-1] < 60, lifetimes[-10:]
        # Cut by the header deadline (not by a dribbled line or anything later): within a few seconds of it.
        assert defaults.header_timeout_s < lifetimes[0] and lifetimes[-1] < defaults.header_timeout_s + 5, \
            (lifetimes[:3], lifetimes[-3:])
        answered = sum(status(answer) == 408 for _, answer in results)
        assert answered >= 0.9 * SLOWLORIS, f"{answered} of {SLOWLORIS} slowloris connections were told 408"
        assert status(lie_answer) == 408, lie_answer[:200]
        assert json_body(lie_answer)["error"]["code"] == "request_timeout"
        assert b"\r\nX-Guard-Tenant: acme\r\n" in lie_answer
        assert defaults.body_timeout_s - 0.5 < lie_s < 30, lie_s
        assert len(latencies) > 20 and max(latencies) < 1.0, sorted(latencies)[-5:]
        counted = cuts(guard)
        assert counted["header_timeout"] == SLOWLORIS and counted["body_timeout"] == 1, counted
        assert counted["idle"] == 0 and counted["over_capacity"] == 0, counted
        await until(lambda: open_connections(guard), lambda n: n <= 1, 5)  # the session's own, kept alive


async def test_the_body_must_keep_coming_at_the_minimum_rate(engine: ServerThread) -> None:
    """A body sent at 2,000 bytes/s outlasts the 1 s body deadline and is served (the deadline grows with
    what has arrived); a body dripped a byte every 0.5 s (never a pause of 1 s, but far below 1,000 bytes/s)
    is cut at about 1 s with a 408; a client that stops after its headers is cut 1 s after them."""
    async with guard_with(engine.url, **SHORT, body_min_rate=1000) as guard:
        body = json.dumps(COMPLETION).encode().ljust(3000)  # JSON allows the padding
        honest_reader, honest = await connect(guard.url)
        honest.write(completion_head(len(body)))
        drip_reader, drip = await connect(guard.url)
        drip.write(completion_head(len(body)))
        silent_reader, silent = await connect(guard.url)
        silent.write(completion_head(len(body)))
        began = time.monotonic()

        async def send_slowly() -> None:
            for offset in range(0, len(body), 200):  # 200 bytes every 0.1 s: 1.5 s in all
                honest.write(body[offset:offset + 200])
                await asyncio.sleep(0.1)

        async def send_dripping() -> None:
            with contextlib.suppress(ConnectionError):
                for byte in body:
                    drip.write(bytes([byte]))
                    await drip.drain()
                    await asyncio.sleep(0.5)

        tasks = [asyncio.create_task(send_slowly()), asyncio.create_task(send_dripping())]
        dripped = asyncio.create_task(timed_until_closed(drip_reader, began, 10))
        silenced = asyncio.create_task(timed_until_closed(silent_reader, began, 10))
        honest_answer = await asyncio.wait_for(honest_reader.readuntil(b"\r\n\r\n"), 10)
        assert status(honest_answer) == 200 and time.monotonic() - began > 1.4, honest_answer
        (dripped_s, drip_answer), (silenced_s, silent_answer) = await asyncio.gather(dripped, silenced)
        for task in tasks:
            task.cancel()
        for writer in (honest, drip, silent):
            writer.close()
        assert status(drip_answer) == 408 and 0.9 < dripped_s < 1.5, (dripped_s, drip_answer[:100])
        assert status(silent_answer) == 408 and 0.9 < silenced_s < 1.5, (silenced_s, silent_answer[:100])
        assert cuts(guard)["body_timeout"] == 2


async def test_idle_keepalive_and_the_next_requests_header_deadline(engine: ServerThread) -> None:
    """A connection that sends nothing is cut (408) at the 1 s header deadline; after a response, an idle
    keep-alive connection stays until the 2 s idle timeout, not the header deadline; the next request's
    header deadline runs from its first byte."""
    async with guard_with(engine.url, **SHORT) as guard:
        mute_reader, mute = await connect(guard.url)
        began = time.monotonic()
        mute_answer = await until_closed(mute_reader, 5)
        assert status(mute_answer) == 408 and 0.9 < time.monotonic() - began < 1.5, mute_answer[:100]

        async def served(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"GET /health HTTP/1.1\r\nHost: guard\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            assert status(head) == 200, head
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            await reader.readexactly(length)

        idle_reader, idle = await connect(guard.url)
        late_reader, late = await connect(guard.url)
        await served(idle_reader, idle)
        await served(late_reader, late)
        answered = time.monotonic()
        await asyncio.sleep(1.5)  # past the header deadline, within the idle timeout
        late.write(b"GET /health HTTP/1.1\r\n")  # the next request starts, and stalls
        started = time.monotonic()
        assert await until_closed(idle_reader, 5) == b""  # a client between requests is owed nothing
        assert 1.9 < time.monotonic() - answered < 2.5
        late_answer = await until_closed(late_reader, 5)
        assert status(late_answer) == 408 and 0.9 < time.monotonic() - started < 1.5, late_answer[:100]
        for writer in (mute, idle, late):
            writer.close()
        counted = cuts(guard)
        assert counted["header_timeout"] == 2 and counted["idle"] == 1, counted


async def test_a_stream_outlives_every_deadline() -> None:
    """A stream of 8 events 0.4 s apart (3.2 s) through a guard whose every deadline is 0.5 s arrives whole:
    a response in progress is never cut. (The fake engine, because it can pace a stream on demand.)"""
    deadlines = {"header_timeout_s": 0.5, "body_timeout_s": 0.5, "keepalive_timeout_s": 0.5}
    with FaultUpstream() as upstream:
        async with guard_with(upstream.url, **deadlines) as guard, aiohttp.ClientSession() as session:
            body = {**COMPLETION, "stream": True, "fault": {"kind": "steady", "events": 8, "interval": 0.4}}
            async with session.post(guard.url + "/v1/completions", json=body,
                                    headers={"Authorization": "Bearer sk-acme"}) as response:
                payload = await response.read()
            assert response.status == 200 and payload.endswith(b"data: [DONE]\n\n"), payload[-200:]
            assert payload.count(b"data: ") == 9
            counted = cuts(guard)
            assert counted["header_timeout"] == counted["body_timeout"] == 0, counted


async def test_connections_over_the_cap_are_refused_with_503(engine: ServerThread) -> None:
    """With ``max_connections: 8`` and 8 connections open, the next is answered 503 (``Retry-After``, the
    OpenAI error shape) and closed, an HTTP client sees the same 503, and once one of the 8 has gone a new
    connection is served again."""
    async with guard_with(engine.url, header_timeout_s=30.0, max_connections=8) as guard:
        await until(lambda: open_connections(guard), lambda n: n == 0, 5)
        held = [await connect(guard.url) for _ in range(8)]
        await until(lambda: open_connections(guard), lambda n: n == 8, 5)
        reader, writer = await connect(guard.url)
        refused = await until_closed(reader, 5)
        writer.close()
        assert status(refused) == 503 and b"\r\nRetry-After: 1\r\n" in refused, refused
        assert json_body(refused)["error"]["code"] == "too_many_connections"
        async with aiohttp.ClientSession() as session, session.get(guard.url + "/health") as response:
            assert response.status == 503 and response.headers["Retry-After"] == "1"
        held.pop()[1].close()
        await until(lambda: open_connections(guard), lambda n: n == 7, 5)
        async with aiohttp.ClientSession() as session, session.get(guard.url + "/health") as response:
            assert response.status == 200
        for _, held_writer in held:
            held_writer.close()
        assert cuts(guard)["over_capacity"] == 2
        assert gauge(guard, "guard_connections_limit") == 8


def test_the_default_cap_leaves_descriptors_to_spare() -> None:
    """Unconfigured, the cap is half the descriptors left after a reserve (each client connection may hold
    one to an engine), at most 10,000; a configured cap above that is lowered to it."""
    assert default_max_connections(1024) == 384
    assert default_max_connections(20_000) == 9_872
    assert default_max_connections(1 << 20) == MAX_CONNECTIONS_CEILING
    assert default_max_connections(resource.RLIM_INFINITY) == MAX_CONNECTIONS_CEILING
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    config = guard_config("http://127.0.0.1:1", connections={"max_connections": 10**9})
    with GuardThread(config) as guard:
        assert gauge(guard, "guard_connections_limit") == default_max_connections(soft)


def test_a_guard_process_guards_its_connections(tmp_path: Path, processes: Processes) -> None:
    """``python -m guard`` serves through the same guard: a stalled request is cut at its header deadline
    and counted in ``/metrics``, and SIGTERM still ends the process cleanly."""
    port = free_port()
    guard_config(f"http://127.0.0.1:{free_port()}", tmp_path, listen={"host": "127.0.0.1", "port": port},
                 connections={"header_timeout_s": 1.0})
    guard = processes.guard(tmp_path / "guard.yaml")

    async def stall() -> tuple[float, bytes]:
        reader, writer = await connect(guard.url)
        writer.write(b"GET /health HTTP/1.1\r\n")
        began = time.monotonic()
        answer = await until_closed(reader, 5)
        writer.close()
        return time.monotonic() - began, answer

    stalled_s, answer = asyncio.run(stall())
    assert status(answer) == 408 and 0.9 < stalled_s < 1.5, (stalled_s, answer[:100])
    _, metrics = request(guard.url + "/metrics")
    assert b'guard_connections_cut_total{reason="header_timeout"} 1.0' in metrics
    assert guard.stop(signal.SIGTERM) == 0, guard.log_tail()
