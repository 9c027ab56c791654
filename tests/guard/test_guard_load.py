"""The guard under load against the real tiny engine: weighted fairness, and backpressure that keeps the
engine from ever preempting while the same load sent straight to it does."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from support.engine_server import ServerThread
from support.guard_server import guard_config, usable_guard

PROMPT = "fair share please"  # 17 byte tokens


async def closed_loop(url: str, key: str | None, body: dict, until: float, results: list) -> None:
    """One client that sends its next request as soon as the previous one ends."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < until:
            async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
                payload = await response.read()
                results.append((response.status, dict(response.headers), payload))


def test_three_backlogged_tenants_share_by_weight() -> None:
    tenants = [{"name": name, "api_keys": [f"sk-{name}"], "weight": weight, "lane": "batch", "max_queue": 100}
               for name, weight in (("a", 1), ("b", 2), ("c", 1))]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with ServerThread(num_blocks=48, block_size=16, max_num_seqs=32) as engine, \
            usable_guard(guard_config(engine.url, tenants=tenants)) as guard:

        def service() -> dict[str, float]:
            return guard.call(lambda: {n: q.service for n, q in guard.state.dispatcher.fair.tenants.items()})

        async def load() -> tuple[dict[str, float], dict[str, float], float]:
            results: list = []
            until = time.monotonic() + 17
            clients = [asyncio.create_task(closed_loop(guard.url, f"sk-{t['name']}", body, until, results))
                       for t in tenants for _ in range(24)]
            await asyncio.sleep(3)  # warm-up: every tenant backlogged
            start = service()
            await asyncio.sleep(12)
            end = service()
            jain = guard.call(lambda: guard.state.dispatcher.fair.jain_index(window_s=12))
            await asyncio.gather(*clients)
            assert all(status == 200 for status, _, _ in results), {s for s, _, _ in results}
            return start, end, jain

        start, end, jain = asyncio.run(load())
        got = {name: end[name] - start[name] for name in end}
        per_weight = got["a"] / 1, got["b"] / 2, got["c"] / 1
        mean = sum(per_weight) / 3
        print("service per tenant over the window:", got, "jain:", jain)
        assert all(abs(x - mean) <= 0.1 * mean for x in per_weight), got
        assert jain >= 0.98, jain
        assert guard.call(lambda: not guard.state.pool.reservations())


@pytest.fixture(scope="module")
def small_engine():
    with ServerThread(num_blocks=64, block_size=16, max_num_seqs=64) as engine:
        yield engine


def test_backpressure_keeps_the_engine_from_preempting(small_engine: ServerThread) -> None:
    engine = small_engine
    # 36 concurrent requests of up to 5 blocks each: about 3x what a 64-block pool holds at once.
    body = {"model": "tiny", "prompt": "x" * 20, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    tenants = [{"name": "load", "api_keys": ["sk-load"], "lane": "batch", "max_queue": 1000}]

    async def burst(url: str, key: str | None) -> list:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with aiohttp.ClientSession() as session:

            async def one() -> tuple:
                async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
                    return response.status, dict(response.headers), await response.read()

            return await asyncio.gather(*(one() for _ in range(36)))

    before = engine.telemetry()["preemptions_total"]
    with usable_guard(guard_config(engine.url, tenants=tenants)) as guard:
        guarded = asyncio.run(burst(guard.url, "sk-load"))
        idle = engine.wait_idle()
        assert idle["preemptions_total"] == before, "the guard kept the engine from preempting"
        assert len(guarded) == 36, "requests in = responses out"
        for status, headers, payload in guarded:
            assert status == 200 or (status in (429, 503) and 1 <= int(headers["Retry-After"]) <= 60), payload
        assert sum(1 for status, _, _ in guarded if status == 200) >= 30
        assert guard.call(lambda: not guard.state.pool.reservations() and not guard.state.pool.reserved_by_tenant())
        assert idle["free_blocks"] + idle["cached_blocks"] == idle["num_blocks"]
        assert guard.call(lambda: all(len(q) == 0 for q in guard.state.dispatcher.fair.tenants.values()))

    direct = asyncio.run(burst(engine.url, None))
    idle = engine.wait_idle()
    assert all(status == 200 for status, _, _ in direct)
    assert idle["preemptions_total"] > before, "the same load straight to the engine preempts"
    assert idle["free_blocks"] + idle["cached_blocks"] == idle["num_blocks"]
