"""Guards that share state through a real Redis, in front of one real engine: one VTC order and one KV
budget across guards, leases that a dead guard loses, and a conservative local mode while Redis is down.
(Verdicts shared across guards: tests/guard/test_verdicts.py.)"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config
from support.net import free_port, request
from support.processes import GuardProcess
from support.redis_server import RedisServer
from support.wait import wait_for

TENANTS = [{"name": "a", "api_keys": ["sk-a"], "weight": 1}, {"name": "b", "api_keys": ["sk-b"], "weight": 2}]


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path) as server:
        yield server


def shared_guard(engine_url: str, redis_url: str) -> GuardThread:
    return GuardThread(guard_config(engine_url, tenants=TENANTS, shared_state={"redis_url": redis_url}))


def joined(*guards: GuardThread, live: int | None = None) -> None:
    """Until every guard's link is up and it sees ``live`` guards (default: these ones)."""
    for guard in guards:
        wait_for(lambda g=guard: g.call(lambda: (g.state.shared.up, g.state.shared.live_guards)),
                 lambda seen: seen == (True, live or len(guards)), 10)
        wait_for(lambda g=guard: g.call(lambda: g.state.pool.any_usable()), bool, 5)


async def flood(url: str, key: str, until: float, tokens: dict[str, int], tenant: str, concurrency: int) -> None:
    """``concurrency`` clients sending 48-token completions back to back until ``until``; counts the tokens
    of requests that finished inside the flood."""
    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < until:
            async with session.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, json={
                    "model": "tiny", "prompt": "x", "max_tokens": 48, "ignore_eos": True}) as answer:
                body = await answer.json()
                if answer.status == 200 and time.monotonic() < until:
                    tokens[tenant] += body["usage"]["completion_tokens"]

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))


def test_two_guards_share_one_fair_order_and_one_budget(redis: RedisServer) -> None:
    """a (weight 1) floods guard 1 and b (weight 2) floods guard 2: b gets twice a's tokens, and the sum of
    both guards' reservations never takes the engine past its pool (no preemption)."""
    with ServerThread(num_blocks=64) as engine, shared_guard(engine.url, redis.url) as g1, \
            shared_guard(engine.url, redis.url) as g2:
        joined(g1, g2)
        tokens = {"a": 0, "b": 0}

        async def run() -> None:
            warm = time.monotonic() + 2.0  # both backlogged before counting
            until = warm + 8.0
            await asyncio.gather(flood(g1.url, "sk-a", warm, {"a": 0}, "a", 16),
                                 flood(g2.url, "sk-b", warm, {"b": 0}, "b", 16))
            await asyncio.gather(flood(g1.url, "sk-a", until, tokens, "a", 16),
                                 flood(g2.url, "sk-b", until, tokens, "b", 16))

        asyncio.run(run())
        ratio = tokens["b"] / max(1, tokens["a"])
        assert 1.6 <= ratio <= 2.4, f"b got {ratio:.2f}x a's tokens ({tokens})"
        assert engine.telemetry()["preemptions_total"] == 0
        for guard in (g1, g2):
            wait_for(lambda g=guard: g.call(lambda: g.state.pool.reservations()), lambda held: not held, 5)


def complete(url: str, key: str, max_tokens: int = 4) -> tuple[int, bytes]:
    return request(url + "/v1/completions", json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": max_tokens,
                                                        "ignore_eos": True}).encode(),
                   {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def test_with_redis_down_each_guard_keeps_to_its_share_and_rejoins_when_it_returns(redis: RedisServer) -> None:
    with ServerThread(num_blocks=64) as engine, shared_guard(engine.url, redis.url) as g1, \
            shared_guard(engine.url, redis.url) as g2:
        joined(g1, g2)
        redis.kill()
        tokens = {"a": 0, "b": 0}

        async def run() -> None:
            until = time.monotonic() + 5.0
            await asyncio.gather(flood(g1.url, "sk-a", until, tokens, "a", 16),
                                 flood(g2.url, "sk-b", until, tokens, "b", 16))

        asyncio.run(run())
        assert tokens["a"] > 0 and tokens["b"] > 0, "both guards served while Redis was down"
        assert engine.telemetry()["preemptions_total"] == 0, "each kept to half of the engine"
        assert not any(g.call(lambda g=g: g.state.shared.up) for g in (g1, g2))
        assert all(g.call(lambda g=g: max(r.gate.reserved for r in g.state.pool)) <= 27 for g in (g1, g2))
        redis.start()  # empty: the guards write back what they hold
        joined(g1, g2)
        assert complete(g1.url, "sk-a")[0] == complete(g2.url, "sk-b")[0] == 200


def test_a_killed_guard_loses_its_reservations_within_its_lease(redis: RedisServer, tmp_path: Path) -> None:
    """Guard 1 (a process) holds nearly the whole budget (52 of 54 blocks) with four streams and is
    SIGKILLed: what it reserved stays in the ledger until its lease lapses (3 s here), so guard 2 admits
    nothing more until then; after it, guard 2 admits 13 requests of 4 blocks with first tokens within 3 s."""
    alone = [{"name": "a", "api_keys": ["sk-a"]}]  # one tenant: guaranteed the whole budget, nothing borrowed
    with ServerThread(num_blocks=64) as engine, \
            GuardThread(guard_config(engine.url, tenants=alone, shared_state={"redis_url": redis.url})) as g2:
        guard_config(engine.url, tmp_path, tenants=alone, listen={"host": "127.0.0.1", "port": free_port()},
                     shared_state={"redis_url": redis.url, "lease_ttl_s": 3})
        with GuardProcess(tmp_path / "guard.yaml", log=tmp_path / "g1.log") as g1:
            joined(g2, live=2)  # guard 2 sees guard 1 (a process, ready once it answers) before it fills up
            body = json.dumps({"model": "tiny", "prompt": "hold", "max_tokens": 200, "ignore_eos": True,
                               "stream": True})
            streams = [subprocess.Popen(["curl", "-sN", g1.url + "/v1/completions", "-H", "Authorization: Bearer sk-a",
                                         "-H", "Content-Type: application/json", "-d", body],
                                        stdout=subprocess.DEVNULL) for _ in range(4)]
            wait_for(lambda: engine.telemetry()["num_running"], lambda n: n == 4, 10)
            g1.kill()
            killed = time.monotonic()
        for stream in streams:
            stream.wait(10)
        assert complete(g2.url, "sk-a", max_tokens=40)[0] == 200  # 3 blocks: 55 > 54 until the lease lapses
        assert 1.0 <= time.monotonic() - killed <= 8.0, "held until guard 1's lease lapsed, not longer"

        async def thirteen() -> list[float]:
            async with aiohttp.ClientSession() as session:
                async def first_token() -> float:
                    sent = time.monotonic()
                    async with session.post(g2.url + "/v1/completions", headers={"Authorization": "Bearer sk-a"},
                                            json={"model": "tiny", "prompt": "p", "max_tokens": 60,
                                                  "ignore_eos": True, "stream": True}) as answer:
                        assert answer.status == 200
                        await answer.content.readline()
                        return time.monotonic() - sent
                return await asyncio.gather(*(first_token() for _ in range(13)))

        assert max(asyncio.run(thirteen())) < 3.0
        assert engine.telemetry()["preemptions_total"] == 0
