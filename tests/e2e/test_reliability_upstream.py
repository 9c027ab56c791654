"""Reliability, upstream faults (issue 7, cases 1, 2, 3, 6, 7, 8): what a client sees when the engine dies,
refuses, hangs, crawls or answers garbage, and that nothing is lost afterwards.

The faults come from ``support.fault_upstream.FaultUpstream`` (a fake engine: a real one cannot produce them on
demand); the real engine serves as the fallback where one is needed. Every test ends with
``assert_nothing_lost``: requests in = responses out, every upstream idle with all its blocks free (for the
fake: every connection the guard opened is closed), no reservation left in the guard.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support.engine_server import ServerThread
from support.fault_upstream import DONE, FaultUpstream, token_event
from support.guard_server import GuardThread, guard_config
from support.net import free_port
from support.nothing_lost import (
    Client,
    Tally,
    assert_nothing_lost,
    assert_openai_error,
    assert_stream_failed,
    ready_guard,
)
from support.wait import until

FAST_ROUTING = {"min_dwell_s": 1.0, "cooldown_s": 0.5, "health_interval_s": 0.2, "failure_threshold": 2}


@pytest.fixture(scope="module")
def fake() -> Iterator[FaultUpstream]:
    with FaultUpstream() as upstream:
        yield upstream


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerThread]:
    with ServerThread(num_blocks=256) as server:
        yield server


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "reliability", "max_tokens": 16, **fields}


async def test_01_upstream_killed_after_n_events_ends_with_an_error_event_and_no_retry(fake: FaultUpstream) -> None:
    tally = Tally()
    async with ready_guard(guard_config(fake.url)) as guard:
        client = Client(guard.url, tally)
        sent_before = fake.received["/v1/completions"]
        answer = await client.call(completion(stream=True, max_tokens=50, fault={"kind": "die_after", "events": 5}))
        error = assert_stream_failed(answer)
        assert error["code"] == "upstream_stream_error", error
        relayed = answer.body[:answer.body.rindex(b"event: error")]
        assert relayed == b"".join(token_event(i) for i in range(5)), "the N events arrive byte for byte"
        assert fake.received["/v1/completions"] == sent_before + 1, "a stream that started is never retried"
        await assert_nothing_lost(guard, tally, [fake])


async def test_02_all_upstreams_down_gives_503_with_retry_after_within_the_connect_budget() -> None:
    """The primary refuses connections; the fallback's host hangs (its accept queue is full, so connection
    attempts are never answered): every request gets a 503 within the connect timeout."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(0)
    filler = socket.create_connection(hung.getsockname())  # the one connection its backlog holds
    tally = Tally()
    connect_timeout = 0.5
    config = guard_config(f"http://127.0.0.1:{free_port()}", routing=FAST_ROUTING,  # nothing listens there
                          fallbacks=[{"name": "small", "url": f"http://127.0.0.1:{hung.getsockname()[1]}"}],
                          upstream={"connect_timeout": connect_timeout})
    try:
        with GuardThread(config) as guard:
            client = Client(guard.url, tally)
            for stream in (False, True, False, True, False):
                started_at = time.monotonic()
                answer = await client.call(completion(stream=stream))
                elapsed = time.monotonic() - started_at
                assert_openai_error(answer, 503, "engine_unavailable")
                # The budget plus slack for a loaded machine; without it, the first-token timeout (60 s) would bound.
                assert elapsed < connect_timeout + 1.0, f"{elapsed:.2f} s is beyond the connect budget"
                await assert_nothing_lost(guard, tally, [])
    finally:
        filler.close()
        hung.close()


async def test_03_refused_before_any_byte_makes_one_attempt_on_the_next_backend(fake: FaultUpstream,
                                                                                 engine: ServerThread) -> None:
    tally = Tally()
    config = guard_config(fake.url, fallbacks=[{"name": "small", "url": engine.url}])
    async with ready_guard(config) as guard:
        client = Client(guard.url, tally)
        sent_before = fake.received["/v1/completions"]
        fake.refuse_after_tokenize()
        try:
            answer = await client.call(completion(max_tokens=4, ignore_eos=True))
        finally:
            fake.accept_connections()
        assert answer.status == 200 and answer.headers["X-Guard-Route"] == "small", answer
        assert answer.json()["usage"]["completion_tokens"] == 4
        assert fake.received["/v1/completions"] == sent_before, "the refused primary got nothing"
        await assert_nothing_lost(guard, tally, [fake, engine])

    tally = Tally()
    refusing = f"http://127.0.0.1:{free_port()}"  # nothing listens on a free port
    config = guard_config(fake.url, fallbacks=[{"name": "small", "url": refusing}])
    async with ready_guard(config) as guard:
        client = Client(guard.url, tally)
        fake.refuse_after_tokenize()
        try:
            answer = await client.call(completion())
        finally:
            fake.accept_connections()
        assert_openai_error(answer, 503, "engine_unavailable")
        attempts = guard.call(lambda: guard.state.metrics.upstream_requests.labels("small", "error")._value.get())
        assert attempts == 1, "exactly one attempt on the next backend"
        await assert_nothing_lost(guard, tally, [fake])


class SlowReader(threading.Thread):
    """A raw-socket client that reads its answer one byte per second with a minimal receive buffer."""

    def __init__(self, guard_url: str, body: bytes, key: str) -> None:
        super().__init__(daemon=True)
        host, port = guard_url.removeprefix("http://").split(":")
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((host, int(port)))
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: guard\r\nContent-Type: application/json\r\n"
                          b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: "
                          + str(len(body)).encode() + b"\r\n\r\n" + body)
        self.dropped_at: float | None = None

    def run(self) -> None:
        """Take one byte a second; notice within 0.1 s when the guard resets the connection (the bytes
        already in the receive buffer would hide that from ``recv`` for an hour)."""
        tick = 0
        while not self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            if tick % 10 == 0:
                try:
                    if not self.sock.recv(1, socket.MSG_DONTWAIT):
                        break  # closed
                except BlockingIOError:
                    pass  # nothing has arrived yet
                except OSError:
                    break  # reset
            tick += 1
            time.sleep(0.1)
        self.dropped_at = time.monotonic()
        self.sock.close()


async def settled(read: Callable[[], int], still_for: float, timeout: float) -> int:
    """The value ``read()`` settles at: the first one that stays unchanged for ``still_for`` seconds."""
    deadline = time.monotonic() + timeout
    value, since = read(), time.monotonic()
    while time.monotonic() - since < still_for:
        assert time.monotonic() < deadline, f"still changing after {timeout} s"
        await asyncio.sleep(0.05)
        if (latest := read()) != value:
            value, since = latest, time.monotonic()
    return value


async def test_06_slow_reader_is_bounded_does_not_slow_others_and_is_dropped(fake: FaultUpstream) -> None:
    """A client reading 1 byte/s from an endless stream: the guard stops reading the upstream once the
    client's buffers are full (so what one stream holds is the socket buffers plus at most a chunk or two in
    the guard, however fast the upstream), other tenants keep their latency, and the stalled stream is
    dropped after ``client_stall_timeout``, which closes its upstream connection."""
    stall_timeout = 2.0
    tally = Tally()
    async with ready_guard(guard_config(fake.url, upstream={"client_stall_timeout": stall_timeout})) as guard:
        client = Client(guard.url, tally, key="sk-globex")

        async def latencies() -> list[float]:
            times = []
            for _ in range(5):
                started_at = time.monotonic()
                assert (await client.call(completion())).status == 200
                times.append(time.monotonic() - started_at)
            return sorted(times)

        baseline = await latencies()
        reader = SlowReader(guard.url, b'{"model": "tiny", "prompt": "slow", "stream": true, '
                                       b'"fault": {"kind": "endless"}}', "sk-bulk")
        tally.sent += 1
        tally.abandoned += 1  # the client that stops reading never gets a whole answer, by design
        sent_before = fake.bytes_sent
        reader.start()
        await until(lambda: fake.active, bool, 5)
        # Bounded: the upstream's bytes stop growing (nothing is read from it) while its stream is still open.
        held = await settled(lambda: fake.bytes_sent - sent_before, still_for=0.5, timeout=stall_timeout)
        stalled_at = time.monotonic() - 0.5
        assert fake.active == 1, "the stream is still open, just not read"
        assert held < 64 << 20, f"{held} bytes in flight for one stalled stream"
        during = await latencies()
        assert during[2] <= max(2 * baseline[2], baseline[2] + 0.2), (baseline, during)
        await until(lambda: reader.dropped_at, bool, stall_timeout + 2)
        assert reader.dropped_at is not None and reader.dropped_at - stalled_at < stall_timeout + 1.5
        await assert_nothing_lost(guard, tally, [fake])


async def test_07_slow_first_token_gives_504_and_a_long_steady_stream_is_not_cut(fake: FaultUpstream) -> None:
    """A "10-minute stream" in miniature: the first-token and idle timeouts are 0.5 s and the legitimate
    stream lasts 3 s, six times either; what matters is that no timeout bounds the total, only the first
    byte and the gap between two reads."""
    tally = Tally()
    config = guard_config(fake.url, upstream={"first_token_timeout": 0.5, "idle_timeout": 0.5, "unary_timeout": 2})
    async with ready_guard(config) as guard:
        client = Client(guard.url, tally)
        started_at = time.monotonic()
        answer = await client.call(completion(stream=True, fault={"kind": "first_token_delay", "seconds": 3}))
        assert_openai_error(answer, 504, "upstream_timeout")
        assert time.monotonic() - started_at < 1.5
        # A non-streamed answer comes whole when generated: past the first-token timeout is not too late...
        answer = await client.call(completion(fault={"kind": "first_token_delay", "seconds": 1}))
        assert answer.status == 200 and answer.json()["usage"]["completion_tokens"] == 16, answer
        # ... but past the unary timeout is.
        started_at = time.monotonic()
        answer = await client.call(completion(fault={"kind": "first_token_delay", "seconds": 3}))
        assert_openai_error(answer, 504, "upstream_timeout")
        assert time.monotonic() - started_at < 2.8
        answer = await client.call(completion(stream=True, fault={"kind": "stall_after", "events": 3}))
        assert_stream_failed(answer)
        assert answer.body.startswith(b"".join(token_event(i) for i in range(3)))

        answer = await client.call(completion(stream=True, fault={"kind": "steady", "events": 30, "interval": 0.1}))
        assert answer.status == 200 and answer.body == b"".join(token_event(i) for i in range(30)) + DONE
        await assert_nothing_lost(guard, tally, [fake])


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_08_garbage_or_html_from_upstream_is_a_502_in_the_openai_shape(fake: FaultUpstream,
                                                                            stream: bool) -> None:
    tally = Tally()
    async with ready_guard(guard_config(fake.url)) as guard:
        client = Client(guard.url, tally)
        for fault in ({"kind": "html", "status": 200}, {"kind": "html", "status": 502}, {"kind": "garbage"},
                      {"kind": "not_http"}, {"kind": "truncated"}):
            answer = await client.call(completion(stream=stream, fault=fault))
            assert_openai_error(answer, 502)
            assert answer.headers["X-Guard-Tenant"] == "acme"
        await assert_nothing_lost(guard, tally, [fake])


async def test_cookies_an_upstream_sets_never_reach_another_request(fake: FaultUpstream) -> None:
    """The guard keeps no cookie jar: an engine's Set-Cookie for one tenant must not ride along with the
    next request, which may be another tenant's."""
    tally = Tally()
    # By name: a cookie jar refuses cookies from a bare IP address, which would make this test pass anyway.
    async with ready_guard(guard_config(fake.url.replace("127.0.0.1", "localhost"))) as guard:
        client = Client(guard.url, tally)
        answer = await client.call(completion(fault={"kind": "set_cookie", "value": "acme-secret"}))
        assert answer.status == 200
        answer = await client.call(completion(), key="sk-globex")
        assert answer.status == 200 and answer.headers["X-Guard-Tenant"] == "globex"
        assert "Cookie" not in fake.headers[-1] and "acme-secret" not in str(fake.headers[-1])
        await assert_nothing_lost(guard, tally, [fake])
