"""Rate limits shared through a real Redis (guard/state/limits.py): two guards' limiters in one process, each
with its own link (``SharedState``), charging one tenant's windows together: rpm and tpm held across both,
settles that free room for the other guard, the 429s and headers, and each guard on half the limit while
Redis is down, shared again once it is back."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from support.redis_server import RedisServer

from guard.admission.limits import Charge
from guard.config import SharedState as SharedStateConfig
from guard.config import Tenant
from guard.errors import GuardError
from guard.metrics import GuardMetrics
from guard.state.limits import SharedCharge, SharedRateLimiter
from guard.state.scripts import rate_key
from guard.state.shared import SharedState

HEADERS = [f"x-ratelimit-{what}-{kind}" for kind in ("requests", "tokens") for what in ("limit", "remaining", "reset")]


def tenant(name: str, **limits: int) -> Tenant:
    return Tenant(name=name, api_keys=[f"sk-{name}"], **limits)


TENANTS = [tenant("acme", rpm=20), tenant("burst", tpm=2000), tenant("refund", tpm=1000),
           tenant("big", rpm=5, tpm=100), tenant("down", rpm=20), tenant("leaver", rpm=1, tpm=500),
           tenant("free")]
BY_NAME = {t.name: t for t in TENANTS}


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path) as server:
        yield server


async def linked(links: list[SharedState], timeout: float = 10.0) -> None:
    """Until every link is up and has seen every guard (what ``SharedState.run`` does, without its pace)."""
    deadline = time.monotonic() + timeout
    while not all(link.up and link.live_guards == len(links) for link in links):
        assert time.monotonic() < deadline, "the links did not come up"
        for link in links:
            await link.resync()
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def two_guards(url: str) -> AsyncIterator[list[SharedRateLimiter]]:
    """Two guards' limiters, each on its own link to Redis, with the link's wire delivered."""
    links = []
    for _ in range(2):
        metrics = GuardMetrics()
        links.append(SharedState(SharedStateConfig(redis_url=url), metrics))
    delivering = [asyncio.create_task(link.deliver()) for link in links]
    try:
        await linked(links)
        yield [SharedRateLimiter(TENANTS, link.metrics, link) for link in links]
    finally:
        for task in delivering:
            task.cancel()
        for link in links:
            await link.close()


async def charge(limiter: SharedRateLimiter, name: str, tokens: int) -> Charge | GuardError:
    """The charge, or the 429 that refused it (checked for what every 429 of a limit must carry)."""
    try:
        return await limiter.charge(BY_NAME[name], tokens)
    except GuardError as error:
        assert (error.status, error.code) == (429, "rate_limit_exceeded")
        assert error.retry_after is not None and 1 <= error.retry_after <= 60
        assert error.headers is not None and all(h.startswith("x-ratelimit-") for h in error.headers)
        return error


def rejections(limiter: SharedRateLimiter, name: str, kind: str) -> float:
    return limiter.metrics.ratelimit_rejections.labels(name, kind)._value.get()


async def window(url: str, name: str, kind: str) -> tuple[int, int]:
    """What Redis holds for a tenant's window (the sum of its entries) and the key's TTL."""
    client = aioredis.Redis.from_url(url)
    try:
        key = rate_key(name, kind)
        return sum(int(v) for v in (await client.hgetall(key)).values()), await client.ttl(key)
    finally:
        await client.aclose()


async def test_rpm_20_across_two_guards_admits_20_of_40(redis: RedisServer) -> None:
    async with two_guards(redis.url) as (g1, g2):
        assert await g1.charge(BY_NAME["free"], 10**9) is None, "a tenant without limits costs no round trip"
        answers, left = [], []
        for i in range(40):
            answers.append(answer := await charge((g1, g2)[i % 2], "acme", 10))
            if isinstance(answer, Charge):  # as the pipeline stamps an answer: what Redis last said
                headers = answer.headers()
                assert headers["x-ratelimit-limit-requests"] == "20" and "x-ratelimit-limit-tokens" not in headers
                left.append(int(headers["x-ratelimit-remaining-requests"]))
        admitted = [a for a in answers if isinstance(a, Charge)]
        assert answers[:20] == admitted and all(isinstance(a, SharedCharge) for a in admitted)
        assert left == list(range(19, -1, -1)), "each guard sees the other's charges"
        for refused in answers[20:]:
            assert isinstance(refused, GuardError)
            assert refused.retry_after is not None and refused.retry_after >= 58, "all charged moments ago"
            assert "'acme' is over its rpm limit of 20 requests per minute" in refused.message
            assert refused.headers is not None and refused.headers["x-ratelimit-limit-requests"] == "20"
            assert refused.headers["x-ratelimit-remaining-requests"] == "0"
            assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
        assert rejections(g1, "acme", "requests") == rejections(g2, "acme", "requests") == 10
        assert ("acme", "requests", 20, 0) in list(g1.levels()) and ("acme", "requests", 20, 0) in list(g2.levels())
        used, ttl = await window(redis.url, "acme", "requests")
        assert used == 20 and 0 < ttl <= 62, "an idle tenant's window expires"
        assert g1.limited["acme"].windows["requests"].used == 10, "each guard's own windows hold its charges"


async def test_tpm_2000_admits_5_of_20_concurrent_400_token_charges(redis: RedisServer) -> None:
    async with two_guards(redis.url) as (g1, g2):
        async def one(limiter: SharedRateLimiter) -> tuple[Charge | GuardError, dict[str, str]]:
            answer = await charge(limiter, "burst", 400)
            return answer, (answer.headers() if isinstance(answer, Charge) else answer.headers or {})

        answers = await asyncio.gather(*(one((g1, g2)[i % 2]) for i in range(20)))
        admitted = [headers for answer, headers in answers if isinstance(answer, Charge)]
        assert len(admitted) == 5
        assert sorted(int(h["x-ratelimit-remaining-tokens"]) for h in admitted) == [0, 400, 800, 1200, 1600]
        for answer, headers in answers:
            if isinstance(answer, GuardError):
                assert "tpm limit of 2000 tokens per minute: this request needs 400, 0 remain" in answer.message
                assert headers["x-ratelimit-limit-tokens"] == "2000"
                assert headers["x-ratelimit-remaining-tokens"] == "0"
        assert rejections(g1, "burst", "tokens") + rejections(g2, "burst", "tokens") == 15
        assert (await window(redis.url, "burst", "tokens"))[0] == 2000


async def test_a_settle_on_one_guard_frees_room_on_the_other(redis: RedisServer) -> None:
    async with two_guards(redis.url) as (g1, g2):
        first = await charge(g1, "refund", 600)
        assert isinstance(first, Charge) and first.headers()["x-ratelimit-remaining-tokens"] == "400"
        refused = await charge(g2, "refund", 600)
        assert isinstance(refused, GuardError) and refused.headers is not None
        assert refused.headers["x-ratelimit-remaining-tokens"] == "400"
        assert refused.headers["x-ratelimit-limit-tokens"] == "1000"
        assert refused.retry_after is not None and refused.retry_after >= 58
        assert "this request needs 600, 400 remain" in refused.message
        first.settle(100)  # used less than charged: the rest comes back, for every guard
        assert ("refund", "tokens", 1000, 900) in list(g1.levels()), "its own settle, without a round trip"
        await until_window(redis.url, "refund", 100)
        second = await charge(g2, "refund", 600)
        assert isinstance(second, Charge) and second.headers()["x-ratelimit-remaining-tokens"] == "300"
        second.settle(700)  # used more: charged the difference
        await until_window(redis.url, "refund", 800)
        second_refused = await charge(g1, "refund", 201)
        assert isinstance(second_refused, GuardError)
        assert g2.limited["refund"].windows["tokens"].used == 700, "settled on the guard's own windows too"
        with pytest.raises(AssertionError, match="exactly once"):
            second.settle(0)


async def until_window(url: str, name: str, used: int, timeout: float = 5.0) -> None:
    """Until Redis holds ``used`` in the tenant's tokens window (a settle is sent, not awaited)."""
    deadline = time.monotonic() + timeout
    while (await window(url, name, "tokens"))[0] != used:
        assert time.monotonic() < deadline, f"the window never held {used}"
        await asyncio.sleep(0.02)


async def test_a_request_too_large_is_refused_and_charges_no_window(redis: RedisServer) -> None:
    async with two_guards(redis.url) as (g1, _):
        error = await charge(g1, "big", 101)
        assert isinstance(error, GuardError) and error.retry_after == 60
        assert "can never be admitted, retrying will not help" in error.message
        assert error.headers is not None and sorted(error.headers) == sorted(HEADERS)
        assert error.headers["x-ratelimit-reset-tokens"] == "0s", "nothing charged: the window is whole"
        assert isinstance(await charge(g1, "big", 60), Charge)
        error = await charge(g1, "big", 60)  # the requests window has room, the tokens one not: neither
        assert isinstance(error, GuardError) and "tpm" in error.message
        assert error.headers is not None and error.headers["x-ratelimit-remaining-requests"] == "4"
        assert (await window(redis.url, "big", "requests"))[0] == 1
        assert rejections(g1, "big", "tokens") == 2 and rejections(g1, "big", "requests") == 0


async def test_a_charge_whose_client_left_during_the_round_trip_is_given_back(redis: RedisServer) -> None:
    async with two_guards(redis.url) as (g1, g2):
        leaving = asyncio.create_task(g1.charge(BY_NAME["leaver"], 300))
        await asyncio.sleep(0)  # sent to Redis, which admits it...
        leaving.cancel()  # ...for a client that is gone: it never settles, so the limiter refunds it
        with pytest.raises(asyncio.CancelledError):
            await leaving
        deadline = time.monotonic() + 5.0
        while round_trips(g1, "rate_settle") == 0:
            assert time.monotonic() < deadline, "the refund was never sent"
            await asyncio.sleep(0.02)
        assert round_trips(g1, "rate_charge") == 1, "Redis did admit it"
        for kind in ("requests", "tokens"):
            assert (await window(redis.url, "leaver", kind))[0] == 0
        assert isinstance(await charge(g2, "leaver", 500), Charge), "the whole limit is there for the next"


def round_trips(limiter: SharedRateLimiter, script: str) -> float:
    value = limiter.metrics.registry.get_sample_value("guard_shared_state_round_trip_seconds_count",
                                                      {"op": script})
    return value or 0.0


async def test_with_redis_down_each_guard_keeps_to_half_and_shares_again_when_it_returns(
        redis: RedisServer) -> None:
    async with two_guards(redis.url) as (g1, g2):
        for _ in range(4):  # shared, and recorded on g1's own windows
            assert isinstance(await charge(g1, "down", 1), Charge)
        redis.kill()
        answers = {g: [await charge(g, "down", 1) for _ in range(15)] for g in (g1, g2)}
        assert not g1.shared.up and not g2.shared.up and g1.shared.live_guards == g2.shared.live_guards == 2
        assert sum(isinstance(a, Charge) for a in answers[g1]) == 10 - 4, "its share, with what it charged before"
        assert sum(isinstance(a, Charge) for a in answers[g2]) == 10
        refused = answers[g2][-1]
        assert isinstance(refused, GuardError) and "admits 1/2 of the limit" in refused.message
        assert refused.headers is not None and refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert ("down", "requests", 20, 0) in list(g1.levels()), "the metrics read what it enforces"

        redis.start()  # empty: the windows start over
        await linked([g1.shared, g2.shared])
        shared = [await charge((g1, g2)[i % 2], "down", 1) for i in range(40)]
        assert sum(isinstance(a, Charge) for a in shared) == 20, "one limit for both guards again, not halves"
