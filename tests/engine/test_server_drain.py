"""Engine drain (SIGTERM), on a real engine process: /health and the telemetry say ``draining``, a new request
is refused with 503 and Retry-After in the OpenAI error shape, the requests in flight finish, and the process
exits 0; with a drain timeout that ends first, what still runs ends with ``resume_elsewhere``, and resumed
on another engine with the token ids it had sent, the answer completes as if nothing had happened."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import aiohttp
from support.engine_server import ServerThread
from support.net import health
from support.processes import Processes
from support.wait import until

BODY = {"model": "tiny", "prompt": "Drain me", "temperature": 0.0, "ignore_eos": True, "stream": True,
        "return_token_ids": True}


async def read_events(response: aiohttp.ClientResponse, started: asyncio.Event) -> list[str]:
    """The stream's raw events (comment lines included); ``started`` is set at the first."""
    events, buffer = [], b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        *whole, buffer = buffer.split(b"\n\n")
        events += [event.decode() for event in whole]
        if events:
            started.set()
    return events


def tokens_and_text(events: list[str]) -> tuple[list[int], str, dict[str, Any] | None]:
    """The token ids the events' comments carried, their text, and the error event's error (None: none)."""
    tokens, text, error = [], "", None
    for event in events:
        for line in event.split("\n"):
            if line.startswith(": token_ids 0 "):
                tokens += [int(t) for t in line.rsplit(" ", 1)[1].split(",")]
            elif line.startswith("data: {"):
                data = json.loads(line[6:])
                if "error" in data:
                    error = data["error"]
                else:
                    text += "".join(choice["text"] for choice in data["choices"])
    return tokens, text, error


async def stream_in_flight(session: aiohttp.ClientSession, url: str, max_tokens: int
                           ) -> tuple[asyncio.Task[list[str]], asyncio.Event]:
    started = asyncio.Event()
    response = await session.post(url + "/v1/completions", json={**BODY, "max_tokens": max_tokens})
    assert response.status == 200
    return asyncio.create_task(read_events(response, started)), started


async def test_sigterm_drains_refuses_new_work_finishes_what_runs_and_exits_0(processes: Processes) -> None:
    engine = processes.engine("--num-blocks", "256", "--drain-timeout", "30")
    async with aiohttp.ClientSession() as session:
        flights = [await stream_in_flight(session, engine.url, 400) for _ in range(3)]
        await asyncio.gather(*(started.wait() for _, started in flights))
        engine.send_signal(signal.SIGTERM)
        await until(lambda: health(engine.url), lambda status: status == 503, 10)  # the signal has arrived
        async with session.get(engine.url + "/health") as answer:
            assert (answer.status, await answer.json()) == (503, {"status": "draining"})
        async with session.get(engine.url + "/telemetry") as telemetry:
            assert (await telemetry.json())["draining"] is True
        async with session.post(engine.url + "/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "late"}]}) as late:
            assert late.status == 503 and late.headers["Retry-After"] == "1"
            error = (await late.json())["error"]
            assert error["code"] == "engine_draining" and set(error) == {"message", "type", "param", "code"}
        for task, _ in flights:
            events = await task
            tokens, _, error = tokens_and_text(events)
            assert error is None and events[-1] == "data: [DONE]" and len(tokens) == 400
    assert await asyncio.to_thread(engine.wait, 30) == 0
    assert "engine: drained (0 requests ended to resume elsewhere)" in engine.log_text()


async def test_what_runs_at_the_drain_deadline_ends_to_be_resumed_elsewhere(processes: Processes) -> None:
    engine = processes.engine("--num-blocks", "256", "--drain-timeout", "0")
    async with aiohttp.ClientSession() as session:
        task, started = await stream_in_flight(session, engine.url, 600)
        unary = asyncio.ensure_future(session.post(engine.url + "/v1/completions", json={
            **BODY, "stream": False, "max_tokens": 600}))
        await started.wait()
        engine.send_signal(signal.SIGTERM)
        tokens, text, error = tokens_and_text(await task)
        answer = await unary
        assert answer.status == 503 and (await answer.json())["error"]["code"] == "resume_elsewhere"
    assert error is not None and error["code"] == "resume_elsewhere", error
    assert 0 < len(tokens) < 600
    assert await asyncio.to_thread(engine.wait, 30) == 0
    # Another engine takes the stream over where it stopped; together they make the uninterrupted answer.
    with ServerThread(num_blocks=256) as other:
        async with aiohttp.ClientSession() as session:
            whole, started = await stream_in_flight(session, other.url, 600)
            rest = await session.post(other.url + "/v1/completions", json={
                **BODY, "max_tokens": 600, "resume_token_ids": tokens})
            rest_tokens, rest_text, rest_error = tokens_and_text(await read_events(rest, asyncio.Event()))
            whole_tokens, whole_text, _ = tokens_and_text(await whole)
    assert rest_error is None
    assert tokens + rest_tokens == whole_tokens and text + rest_text == whole_text
