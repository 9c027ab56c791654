"""Reliability, clients that leave (issue 7, cases 4 and 5), against the real engine: a client that hangs up
while queued is forgotten without the engine ever hearing of it; one that hangs up before its first token
or mid-stream has its engine request aborted within a second. Every case ends with nothing lost."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import suppress
from typing import Any

import aiohttp
import pytest
from support.engine_server import ServerThread
from support.guard_server import guard_config
from support.nothing_lost import Client, Tally, assert_nothing_lost, ready_guard
from support.wait import until

# One sequence at a time, so a request can be made to wait inside the engine, before its first token.
ENGINE = {"num_blocks": 64, "block_size": 16, "max_num_seqs": 1}


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerThread]:
    with ServerThread(**ENGINE) as server:
        yield server


def body(max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "x" * 15, "max_tokens": max_tokens, "ignore_eos": True, **fields}


def tenant_usage(engine: ServerThread, tenant: str) -> dict[str, int]:
    return engine.telemetry()["tenants"].get(tenant, {"running": 0, "waiting": 0, "prompt_tokens_total": 0})


async def leave(task: asyncio.Task, tally: Tally) -> float:
    """Hang up the request ``task`` is making; returns when."""
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    tally.abandoned += 1
    return time.monotonic()


async def test_04_client_leaving_while_queued_is_removed_and_the_engine_never_hears_of_it(
        engine: ServerThread) -> None:
    tally = Tally()
    async with ready_guard(guard_config(engine.url)) as guard:
        client = Client(guard.url, tally)
        globex_before = tenant_usage(engine, "globex")["prompt_tokens_total"]
        # 51 of the 54 blocks the guard may commit: globex's 16-block request, past its guarantee of 13 (a
        # quarter of the budget), waits for idle room behind it.
        blocker = asyncio.create_task(client.call(body(800, stream=True)))
        await until(lambda: guard.call(lambda: guard.state.pool.tenant_reserved("acme")), bool, 5)
        queued = asyncio.create_task(client.call(body(240), key="sk-globex"))

        def globex_queue() -> int:
            return guard.call(lambda: len(guard.state.dispatcher.fair.tenants["globex"]))

        await until(globex_queue, lambda n: n == 1, 5)
        left = await leave(queued, tally)
        await until(globex_queue, lambda n: n == 0, 1)
        assert time.monotonic() - left < 1
        assert (await blocker).status == 200
        assert tenant_usage(engine, "globex")["prompt_tokens_total"] == globex_before, "never sent upstream"
        primary_calls = guard.call(lambda: guard.state.metrics.upstream_requests.labels("primary", "200")._value.get())
        assert primary_calls == 1, "only the blocker reached the engine"
        await assert_nothing_lost(guard, tally, [engine])


async def test_05_client_leaving_before_its_first_token_or_mid_stream_aborts_its_engine_request(
        engine: ServerThread) -> None:
    tally = Tally()
    async with ready_guard(guard_config(engine.url)) as guard:
        client = Client(guard.url, tally)
        # Before the first token: the engine runs one sequence at a time, so globex's waits inside it.
        blocker = asyncio.create_task(client.call(body(600, stream=True)))
        await until(lambda: tenant_usage(engine, "acme")["running"], bool, 5)
        waiting = asyncio.create_task(client.call(body(64, stream=True), key="sk-globex"))
        await until(lambda: tenant_usage(engine, "globex")["waiting"], bool, 5)
        left = await leave(waiting, tally)
        await until(lambda: tenant_usage(engine, "globex")["waiting"], lambda n: n == 0, 1)
        assert time.monotonic() - left < 1
        assert (await blocker).status == 200

        # Mid-stream: a few events read, then the client hangs up.
        async with aiohttp.ClientSession() as session:
            tally.sent += 1
            response = await session.post(guard.url + "/v1/completions", json=body(800, stream=True),
                                          headers={"Authorization": "Bearer sk-globex"})
            assert response.status == 200 and (await response.content.readany()).startswith(b"data: ")
            await until(lambda: engine.telemetry()["num_running"], lambda n: n == 1, 1)
            response.close()
            tally.abandoned += 1
            left = time.monotonic()
        await until(lambda: engine.telemetry()["num_running"], lambda n: n == 0, 1)
        assert time.monotonic() - left < 1
        await assert_nothing_lost(guard, tally, [engine])
