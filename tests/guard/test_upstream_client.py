"""The guard's upstream HTTP client (guard/wire/upstream.py) against real servers on loopback: aiohttp's (what
the engine runs) and, for the answers aiohttp never gives, a raw asyncio server that writes given bytes.
The relay's behaviour on top of it (failures, revokes, shutdown) is tested through the guard in
tests/e2e/test_reliability_upstream.py and test_reliability_lifecycle.py; its tracking of a resumable answer
whose wait is cancelled, here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from guard.config import Upstream
from guard.wire.relay import Relay
from guard.wire.resume_tap import ResumeTap
from guard.wire.upstream import HIGH_WATER, BadResponse, ConnectFailed, Disconnected, UpstreamClient
from tests.support.net import free_port


@pytest.fixture
async def engine_like() -> AsyncIterator[tuple[str, list]]:
    """An aiohttp server: /json answers a small JSON object, /stream ``n`` SSE events as chunks, /close a
    JSON object with ``Connection: close``; ``peers`` lists each request's client port."""
    peers: list[int] = []

    async def json_answer(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername")[1])
        return web.json_response({"echo": (await request.read()).decode(), "tenant": request.headers["X-Tenant-Id"]})

    async def close_answer(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername")[1])
        return web.json_response({}, headers={"Connection": "close"})

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(int(request.query.get("n", "3"))):
            await response.write(b"data: %d\n\n" % i)
            await asyncio.sleep(0.01)
        await response.write_eof()
        return response

    async def big(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await response.prepare(request)
        for _ in range(64):
            await response.write(b"x" * 65536)
        await response.write_eof()
        return response

    app = web.Application()
    for path, handler in (("/json", json_answer), ("/close", close_answer), ("/stream", stream), ("/big", big)):
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}", peers
    await runner.cleanup()


async def raw_server(answer: Callable[[asyncio.StreamReader, asyncio.StreamWriter], object]) -> tuple[str, asyncio.Server]:
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", server


HEADERS = {"Content-Type": "application/json", "X-Tenant-Id": "acme"}


async def test_answers_reuse_one_keep_alive_connection(engine_like):
    url, peers = engine_like
    client = UpstreamClient(connect_timeout=1.0)
    for i in range(3):
        async with await client.post(url + "/json", b"body %d" % i, HEADERS, 2.0, 2.0) as answer:
            assert answer.status == 200 and answer.content_type == "application/json"
            assert await answer.read() == b'{"echo": "body %d", "tenant": "acme"}' % i
    assert len(set(peers)) == 1, "each request opened a connection of its own"
    client.close()


async def test_an_answer_given_back_twice_leaves_its_pooled_connection_alone(engine_like):
    """Released twice, an answer pooled its connection twice, and two answers then shared it; closed after its
    release, it aborted the connection another answer may have taken from the pool."""
    url, peers = engine_like
    client = UpstreamClient(connect_timeout=1.0)
    answer = await client.post(url + "/json", b"first", HEADERS, 2.0, 2.0)
    await answer.read()
    answer.release()
    answer.release()
    both = await asyncio.gather(*(client.post(url + "/json", b"at once %d" % i, HEADERS, 2.0, 2.0) for i in range(2)))
    assert [await a.read() for a in both] == [b'{"echo": "at once %d", "tenant": "acme"}' % i for i in range(2)]
    assert len(set(peers[1:])) == 2
    for done in both:
        done.release()
        done.close()  # after its release: the pooled connection stays
    async with await client.post(url + "/json", b"again", HEADERS, 2.0, 2.0) as again:
        await again.read()
    assert peers[-1] in peers[1:3], "a released answer's close dropped its pooled connection"
    client.close()


async def test_connection_close_is_not_reused(engine_like):
    url, peers = engine_like
    client = UpstreamClient(connect_timeout=1.0)
    for _ in range(2):
        async with await client.post(url + "/close", b"{}", HEADERS, 2.0, 2.0) as answer:
            await answer.read()
    assert len(set(peers)) == 2


async def test_a_stream_arrives_chunk_by_chunk(engine_like):
    url, _ = engine_like
    client = UpstreamClient(connect_timeout=1.0)
    answer = await client.post(url + "/stream?n=5", b"{}", HEADERS, 2.0, 2.0)
    assert answer.content_type == "text/event-stream"
    chunks = []
    while chunk := await answer.readany():
        chunks.append(chunk)
    assert len(chunks) > 1 and b"".join(chunks) == b"".join(b"data: %d\n\n" % i for i in range(5))
    assert answer.is_eof()
    answer.release()
    client.close()


async def test_a_reader_that_does_not_read_pauses_the_socket(engine_like):
    url, _ = engine_like
    client = UpstreamClient(connect_timeout=1.0)
    answer = await client.post(url + "/big", b"{}", HEADERS, 2.0, 2.0)
    await asyncio.sleep(0.3)  # 4 MiB offered; the answer holds about its high-water mark
    assert answer._connection.paused and answer._size < 4 * HIGH_WATER
    assert len(await answer.read()) == 64 * 65536  # and reading resumes it to the end
    answer.release()
    client.close()


async def test_a_refused_connection_is_connect_failed():
    client = UpstreamClient(connect_timeout=1.0)
    with pytest.raises(ConnectFailed):
        await client.post(f"http://127.0.0.1:{free_port()}/x", b"{}", HEADERS, 1.0, 1.0)


async def test_a_header_with_a_line_break_is_refused_before_sending(engine_like):
    url, peers = engine_like
    client = UpstreamClient(connect_timeout=1.0)
    with pytest.raises(ValueError, match="line break"):
        await client.post(url + "/json", b"{}", {**HEADERS, "X-Tenant-Id": "a\r\nX-Evil: 1"}, 1.0, 1.0)
    assert peers == []


async def test_silence_times_out_and_drops_the_connection():
    closed = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client hangs up
        closed.set()

    url, server = await raw_server(silent)
    client = UpstreamClient(connect_timeout=1.0)
    with pytest.raises(TimeoutError):
        await client.post(url + "/x", b"{}", HEADERS, 0.2, 0.2)
    await asyncio.wait_for(closed.wait(), 2.0)
    server.close()


@pytest.mark.parametrize("sent, error", [
    (b"this is not http\r\n\r\n", BadResponse),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort", Disconnected),
])
async def test_a_broken_answer_raises_upstream_error(sent, error):
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(sent)
        await writer.drain()
        writer.close()

    url, server = await raw_server(broken)
    client = UpstreamClient(connect_timeout=1.0)
    with pytest.raises(error):
        answer = await client.post(url + "/x", b"", HEADERS, 1.0, 1.0)
        await answer.read()
    server.close()


async def test_each_wait_on_a_reused_connection_keeps_its_own_deadline():
    """The connection's one timer outlives its answers: a timer set for an earlier answer's deadline must not
    end a later, longer wait, and a later, shorter wait must not wait for a timer set further out."""
    accepted = []

    async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        while head := await reader.readuntil(b"\r\n\r\n"):
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            path = head.split(b" ")[1]
            if path == b"/never":
                await reader.read()  # until the client hangs up
                return
            if path == b"/late":
                await asyncio.sleep(0.6)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()

    url, server = await raw_server(keep_alive)
    client = UpstreamClient(connect_timeout=1.0)
    first = await client.post(url + "/now", b"{}", HEADERS, 0.3, 0.3)  # its timer is set for 0.3 s from now
    assert await first.read() == b"{}"
    first.release()
    late = await client.post(url + "/late", b"{}", HEADERS, 3.0, 3.0)  # outlasts that timer, within its own
    assert await late.read() == b"{}"
    late.release()
    begun = asyncio.get_running_loop().time()
    with pytest.raises(TimeoutError):  # the pending timer is 2.4 s out: this wait must set an earlier one
        await client.post(url + "/never", b"{}", HEADERS, 0.2, 0.2)
    assert asyncio.get_running_loop().time() - begun < 1.0
    assert len(accepted) == 1  # all three on one connection
    server.close()


async def test_a_resumable_answer_cancelled_before_its_headers_is_forgotten():
    """A client that leaves while the engine has not answered yet cancels the relay's wait: the answer is
    closed and no longer tracked under its backend (the silence watch reads those)."""
    async def never(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client hangs up

    url, server = await raw_server(never)
    relay = Relay(UpstreamClient(connect_timeout=1.0), Upstream())
    opening = asyncio.ensure_future(relay.open(url + "/x", b"{}", HEADERS, True, "e0", ResumeTap()))
    while not relay.answers_of("e0"):  # sent, its headers not come
        await asyncio.sleep(0.01)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    assert relay.answers_of("e0") == {}
    server.close()
