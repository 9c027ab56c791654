"""The guard's front (guard/wire/front.py), on raw sockets: what it serves itself and what it hands to aiohttp
must read, to a client, like one HTTP/1.1 server.

- keep-alive across the hand-over: a completion, then another route, then a completion, on one connection;
- one task serves a connection's requests in turn, and ends when the connection is handed over or closed;
- pipelining: three requests written at once are answered in order;
- ``Expect: 100-continue`` with a chunked body: the 100 comes before the body is sent;
- HTTP/1.0, bytes that do not parse and a header past aiohttp's limit: answered, and the connection closed;
- a client that leaves mid-stream gives its reservation back;
- a header that must come once, sent twice (two keys, two request ids, two classes, two SLO headers in
  different cases): 400 naming it, on the front's routes and on aiohttp's, and the connection serves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator

import pytest
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config, usable_guard
from support.nothing_lost import guard_holds_nothing
from support.wait import until

from guard.wire.connections import CONNECTIONS

COMPLETION = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 2}).encode()
CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}).encode()


@pytest.fixture(scope="module")
def guard() -> Iterator[GuardThread]:
    with ServerThread(num_blocks=256) as engine, usable_guard(guard_config(engine.url)) as guard:
        yield guard


def post(path: str, body: bytes, request_id: str = "", extra: str = "") -> bytes:
    ids = f"X-Request-Id: {request_id}\r\n" if request_id else ""
    return (f"POST {path} HTTP/1.1\r\nHost: guard\r\nAuthorization: Bearer sk-acme\r\n{ids}{extra}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


async def connect(guard: GuardThread) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = guard.url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One answer with a ``Content-Length``: status, headers (lower-cased names) and body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status_line, *lines = head.decode().split("\r\n")[:-2]
    headers = {name.lower(): value for name, value in (line.split(": ", 1) for line in lines)}
    return int(status_line.split()[1]), headers, await reader.readexactly(int(headers["content-length"]))


async def closed(reader: asyncio.StreamReader) -> bool:
    with contextlib.suppress(ConnectionResetError):
        return await asyncio.wait_for(reader.read(), 10) == b""
    return True


async def test_keep_alive_across_the_hand_over_to_aiohttp(guard: GuardThread,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The front serves the first completion (and logs it where aiohttp logs its requests); ``GET /health``
    goes to aiohttp, re-framed from what the front parsed; aiohttp then serves the connection, the next
    completion included."""
    reader, writer = await connect(guard)
    with caplog.at_level(logging.INFO, logger="aiohttp.access"):
        writer.write(post("/v1/completions", COMPLETION))
        status, headers, body = await answer(reader)
        assert status == 200 and headers["x-guard-tenant"] == "acme" and json.loads(body)["usage"], body
        # Logged right after the answer is handed to the transport (on the guard's thread).
        await until(lambda: [r.getMessage() for r in caplog.records],
                    lambda lines: any('"POST /v1/completions HTTP/1.1" 200 ' in line for line in lines), 2)
    writer.write(b"GET /health?probe=1 HTTP/1.1\r\nHost: guard\r\nX-Note: caf\xc3\xa9\r\n\r\n")
    status, headers, body = await answer(reader)
    assert status == 200 and json.loads(body)["status"] == "ok", body
    writer.write(post("/v1/chat/completions", CHAT))
    status, headers, body = await answer(reader)
    assert status == 200 and headers["x-guard-tenant"] == "acme" and json.loads(body)["choices"], body
    writer.close()


def front_tasks(guard: GuardThread) -> list[asyncio.Task | None]:
    """The task of each client connection the front serves (guard/wire/front.py ``FrontConnection.task``)."""
    return guard.call(lambda: [c.handler.task for c in guard.app[CONNECTIONS].connections
                               if hasattr(c.handler, "close_idle") and c.handler.aiohttp is None])


async def test_one_task_serves_a_connections_requests_and_ends_with_it(guard: GuardThread) -> None:
    """Requests in turn on one keep-alive connection are served by one task, which waits between them and
    ends when the connection is handed to aiohttp or closed: none is left behind."""
    reader, writer = await connect(guard)
    seen = []
    for i in range(3):
        writer.write(post("/v1/completions", COMPLETION, f"turn-{i}"))
        status, headers, _ = await answer(reader)
        assert status == 200 and headers["x-request-id"] == f"turn-{i}"
        seen.append(await until(lambda: front_tasks(guard), lambda tasks: len(tasks) == 1, 5))
    assert seen[0][0] is not None and all(tasks == seen[0] for tasks in seen), "one task for the three"
    task = seen[0][0]
    writer.write(b"GET /health HTTP/1.1\r\nHost: guard\r\n\r\n")
    assert (await answer(reader))[0] == 200
    await until(lambda: guard.call(task.done), bool, 5)  # handed over: the task has nothing more to serve
    writer.close()
    reader, writer = await connect(guard)  # a client that leaves while its connection waits between requests
    writer.write(post("/v1/completions", COMPLETION))
    assert (await answer(reader))[0] == 200
    (task,) = await until(lambda: front_tasks(guard), lambda tasks: len(tasks) == 1 and tasks[0] is not None, 5)
    writer.close()
    await until(lambda: guard.call(task.done), bool, 5)


async def test_pipelined_requests_are_answered_in_order(guard: GuardThread) -> None:
    reader, writer = await connect(guard)
    writer.write(post("/v1/completions", COMPLETION, "first") + post("/v1/chat/completions", CHAT, "second")
                 + b"GET /v1/models HTTP/1.1\r\nHost: guard\r\nAuthorization: Bearer sk-acme\r\n"
                   b"X-Request-Id: third\r\n\r\n" + post("/v1/completions", COMPLETION, "fourth"))
    answers = [await answer(reader) for _ in range(4)]
    assert [(status, headers["x-request-id"]) for status, headers, _ in answers] == [
        (200, "first"), (200, "second"), (200, "third"), (200, "fourth")], answers
    assert json.loads(answers[2][2])["data"], answers[2]
    writer.close()


async def test_expect_100_continue_with_a_chunked_body(guard: GuardThread) -> None:
    reader, writer = await connect(guard)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: guard\r\nAuthorization: Bearer sk-acme\r\n"
                 b"Content-Type: application/json\r\nExpect: 100-continue\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10) == b"HTTP/1.1 100 Continue\r\n\r\n"
    half = len(COMPLETION) // 2
    for part in (COMPLETION[:half], COMPLETION[half:]):
        writer.write(b"%x\r\n%b\r\n" % (len(part), part))
        await asyncio.sleep(0.05)
    writer.write(b"0\r\n\r\n")
    status, _, body = await answer(reader)
    assert status == 200 and json.loads(body)["choices"][0]["text"] is not None, body
    writer.close()


async def test_http_1_0_and_malformed_bytes_are_answered_and_closed(guard: GuardThread) -> None:
    reader, writer = await connect(guard)  # a client that asks to close is closed as soon as it is answered
    writer.write(post("/v1/completions", COMPLETION, extra="Connection: close\r\n"))
    status, headers, _ = await answer(reader)
    answered = time.monotonic()
    assert status == 200 and headers["connection"] == "close", headers
    assert await closed(reader) and time.monotonic() - answered < 0.5
    writer.close()
    reader, writer = await connect(guard)
    writer.write(post("/v1/completions", COMPLETION).replace(b"HTTP/1.1", b"HTTP/1.0", 1))
    status, headers, _ = await answer(reader)
    assert status == 200 and headers["x-guard-tenant"] == "acme", headers
    assert await closed(reader)
    writer.close()
    reader, writer = await connect(guard)
    writer.write(post("/v1/completions", COMPLETION) + b"\x00 not http\r\n\r\n")
    assert (await answer(reader))[0] == 200
    status, _, body = await answer(reader)
    assert status == 400 and json.loads(body)["error"]["code"] == "invalid_request", body
    assert await closed(reader)
    writer.close()
    reader, writer = await connect(guard)  # aiohttp's header limit holds on the front's connections too
    big = "X-Big: " + "a" * 9000 + "\r\n"
    writer.write(post("/v1/completions", COMPLETION) + post("/v1/completions", COMPLETION, extra=big))
    assert (await answer(reader))[0] == 200
    status, _, body = await answer(reader)
    assert status == 400 and "8190 bytes" in json.loads(body)["error"]["message"], body
    writer.close()


async def test_a_client_that_leaves_mid_stream_gives_its_blocks_back(guard: GuardThread) -> None:
    body = json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 400, "ignore_eos": True,
                       "stream": True}).encode()
    reader, writer = await connect(guard)
    writer.write(post("/v1/completions", body))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert head.startswith(b"HTTP/1.1 200 ") and b"Transfer-Encoding: chunked" in head, head
    await asyncio.wait_for(reader.readuntil(b"data: "), 10)
    assert guard.call(lambda: guard.state.pool.reservations()), "the stream holds its reservation"
    writer.transport.abort()
    await until(lambda: guard_holds_nothing(guard), lambda held: held == ({}, 0), 5)


@pytest.mark.parametrize(("twice", "named"), [
    ("Authorization: Bearer sk-bulk\r\n", "Authorization"),  # the key the guard would not have read
    ("Authorization: Bearer sk-acme\r\n", "Authorization"),  # even the same key: one header, one key
    ("X-Request-Id: one\r\nx-request-id: two\r\n", "X-Request-Id"),
    ("X-Priority-Class: critical\r\nX-Priority-Class: sheddable\r\n", "X-Priority-Class"),
    ("X-SLO-TTFT-Ms: 900\r\nx-slo-ttft-ms: 90000\r\n", "X-SLO-TTFT-Ms"),
])
async def test_a_header_that_must_come_once_sent_twice_is_refused(guard: GuardThread, twice: str,
                                                                   named: str) -> None:
    reader, writer = await connect(guard)
    writer.write(post("/v1/completions", COMPLETION, extra=twice))
    status, headers, body = await answer(reader)
    error = json.loads(body)["error"]
    assert status == 400 and error["code"] == "ambiguous_header" and error["param"] == named, body
    assert named in error["message"] and "x-guard-tenant" not in headers
    # The same on a route aiohttp serves, on the same connection (handed over after the refusal).
    writer.write(f"GET /v1/models HTTP/1.1\r\nHost: guard\r\nAuthorization: Bearer sk-acme\r\n{twice}\r\n"
                 .encode())
    status, _, body = await answer(reader)
    assert status == 400 and json.loads(body)["error"]["param"] == named, body
    writer.write(post("/v1/completions", COMPLETION))
    status, headers, body = await answer(reader)
    assert status == 200 and headers["x-guard-tenant"] == "acme", body
    writer.close()
