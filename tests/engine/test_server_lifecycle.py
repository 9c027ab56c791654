"""Every request ends in a completion or an explicit error, and every block comes back: client disconnects,
failing steps, shutdown mid-stream, and an engine that never loaded."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from support.engine_server import ServerThread
from support.invariants import assert_all_blocks_back
from support.net import request
from support.wait import wait_for

from engine.server.async_engine import MAX_CONSECUTIVE_STEP_FAILURES

LONG = {"model": "tiny", "prompt": "a long generation", "max_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(num_blocks=256, block_size=16) as running:
        yield running


def open_post(server: ServerThread, body: dict) -> http.client.HTTPConnection:
    address = urlsplit(server.url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=30)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return connection


def read_events(response: http.client.HTTPResponse, count: int | None = None) -> list[bytes]:
    """Read SSE lines (events and comments, blank separators dropped) until ``count`` or the end."""
    lines = []
    while count is None or len(lines) < count:
        line = response.readline()
        if not line:
            break
        if line.strip():
            lines.append(line.strip())
    return lines


def running_with_blocks(server: ServerThread) -> dict:
    return wait_for(server.telemetry,
                    lambda s: s["num_running"] == 1 and s["free_blocks"] + s["cached_blocks"] < s["num_blocks"], 5)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_blocks_within_a_second(server: ServerThread, stream: bool) -> None:
    connection = open_post(server, {**LONG, "stream": stream})
    if stream:
        response = connection.getresponse()
        assert len(read_events(response, 3)) == 3
    running_with_blocks(server)
    connection.close()
    left = time.monotonic()
    snap = wait_for(server.telemetry,
                    lambda s: s["free_blocks"] + s["cached_blocks"] == s["num_blocks"] and s["num_running"] == 0, 1.0)
    assert time.monotonic() - left < 1.0
    assert snap["generation_tokens_total"] < 1000, "aborted long before its 1500 tokens"
    assert_all_blocks_back(server.core)


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(server: ServerThread,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    runner = server.core.runner

    def broken(*args: object) -> None:
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(runner, "execute", broken)
    status, body = request(server.url + "/v1/completions", json.dumps({**LONG, "max_tokens": 5}).encode())
    error = json.loads(body)["error"]
    assert status == 500 and error["code"] == "engine_step_failed" and "injected device fault" in error["message"]
    response = open_post(server, {**LONG, "stream": True}).getresponse()
    events = read_events(response)
    assert events[0] == b"event: error" and b"engine_step_failed" in events[1]
    assert b"data: [DONE]" not in events
    assert_all_blocks_back(server.core)

    for _ in range(MAX_CONSECUTIVE_STEP_FAILURES - 2):
        request(server.url + "/v1/completions", json.dumps({**LONG, "max_tokens": 5}).encode())
    assert request(server.url + "/health")[0] == 503
    assert server.telemetry()["healthy"] is False

    monkeypatch.undo()
    status, body = request(server.url + "/v1/completions", json.dumps({**LONG, "max_tokens": 5}).encode())
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 5
    assert request(server.url + "/health") == (200, b'{"status": "ready"}')
    assert server.wait_idle()["healthy"] is True
    assert_all_blocks_back(server.core)


def test_shutdown_ends_open_streams_with_an_error() -> None:
    with ServerThread(num_blocks=128) as server:
        response = open_post(server, {**LONG, "stream": True}).getresponse()
        assert len(read_events(response, 2)) == 2
        server.run(server.server.stop())
        events = read_events(response)
        assert b"event: error" in events and b"data: [DONE]" not in events
        assert b"engine_unavailable" in events[events.index(b"event: error") + 1]
        assert_all_blocks_back(server.server.engine._core)  # stopped: the core is quiet for good


def test_an_engine_that_failed_to_load_says_so() -> None:
    with ServerThread(wait_ready=False, model="/no/such/model") as server:
        wait_for(lambda: request(server.url + "/health"), lambda answer: b"failed" in answer[1], 10)
        assert request(server.url + "/health") == (503, b'{"status": "failed"}')
        status, body = request(server.url + "/v1/completions", json.dumps(LONG).encode())
        assert status == 503 and json.loads(body)["error"]["code"] == "engine_unavailable"
        status, body = request(server.url + "/metrics")
        assert status == 200 and b"engine_healthy 0.0" in body
