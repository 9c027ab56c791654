"""Per-tenant rate limits (guard/admission/limits.py): the windows on a fake clock, then the real guard in front
of the real tiny engine, on both state backends (its own windows, and the windows in a real Redis,
guard/state/limits.py): rpm, tpm charged at admission, settlement, the 429 and the x-ratelimit-* headers."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from types import SimpleNamespace

import aiohttp
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.admission_backends import BACKENDS
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config, usable_guard
from support.net import request
from support.redis_server import RedisServer
from support.wait import wait_for

from guard.admission.limits import WINDOW_S, Charge, RateLimiter, duration
from guard.config import Tenant
from guard.errors import GuardError
from guard.metrics import GuardMetrics

HEADERS = [f"x-ratelimit-{what}-{kind}" for kind in ("requests", "tokens") for what in ("limit", "remaining", "reset")]


# -- the windows, on a fake clock ------------------------------------------------------------------------------
@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.25]
    monkeypatch.setattr("guard.admission.limits.time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def tenant(name: str = "acme", **limits: int) -> Tenant:
    return Tenant(name=name, api_keys=[f"sk-{name}"], **limits)


def charge_now(limiter: RateLimiter, who: Tenant, tokens: int) -> Charge | None:
    """``limiter.charge`` run to its end here: a coroutine for the shared limiter's sake, the local limiter's
    never suspends (which this checks), so these tests need no event loop."""
    coroutine = limiter.charge(who, tokens)
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise AssertionError("the local limiter's charge suspended")


def refused(limiter: RateLimiter, who: Tenant, tokens: int) -> GuardError:
    with pytest.raises(GuardError) as info:
        charge_now(limiter, who, tokens)
    assert (info.value.status, info.value.code) == (429, "rate_limit_exceeded")
    assert 1 <= info.value.retry_after <= 60
    return info.value


def test_rpm_admits_the_limit_per_sliding_minute(clock: list[float]) -> None:
    acme, free = tenant(rpm=3), tenant("free")
    limiter = RateLimiter([acme, free], GuardMetrics())
    assert charge_now(limiter, free, 10**9) is None, "a tenant without limits has no windows"
    for _ in range(3):
        assert charge_now(limiter, acme, 10) is not None
    clock[0] = 1030.5
    error = refused(limiter, acme, 10)
    assert error.retry_after == 31, "the charges of second 1000 leave the window at 1061"
    assert "'acme' is over its rpm limit of 3 requests per minute" in error.message
    assert error.headers == {"x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "0",
                             "x-ratelimit-reset-requests": "30.5s"}
    clock[0] = 1060.999
    refused(limiter, acme, 10)
    clock[0] = 1061.0
    assert charge_now(limiter, acme, 10) is not None
    assert list(limiter.levels()) == [("acme", "requests", 3, 2)]


def test_tpm_is_charged_at_admission_and_settled_to_the_use(clock: list[float]) -> None:
    acme = tenant(tpm=2000)
    limiter = RateLimiter([acme], GuardMetrics())
    charges = [charge_now(limiter, acme, 400) for _ in range(5)]
    error = refused(limiter, acme, 400)
    assert "tpm limit of 2000 tokens per minute: this request needs 400, 0 remain" in error.message
    assert error.headers["x-ratelimit-remaining-tokens"] == "0" and "x-ratelimit-limit-requests" not in error.headers
    charges[0].settle(150)  # used less than charged: the rest comes back at once
    assert charges[0].headers()["x-ratelimit-remaining-tokens"] == "250"
    charges[1].settle(None)  # never reached an engine: all of it comes back
    assert charge_now(limiter, acme, 650) is not None
    charges[2].settle(500)  # used more: charged the difference
    refused(limiter, acme, 1)
    clock[0] = 1000.25 + WINDOW_S + 1  # everything charged in second 1000 has left
    charges[3].settle(700)  # ...so a surplus now counts from now, a refund has nothing left to give back
    charges[4].settle(0)
    assert list(limiter.levels()) == [("acme", "tokens", 2000, 1700)]
    with pytest.raises(AssertionError, match="exactly once"):
        charges[4].settle(0)


def test_a_request_bigger_than_tpm_is_told_that_retrying_will_not_help(clock: list[float]) -> None:
    limiter = RateLimiter([tenant(tpm=100, rpm=5)], GuardMetrics())
    error = refused(limiter, tenant(tpm=100, rpm=5), 101)
    assert error.retry_after == 60 and "can never be admitted, retrying will not help" in error.message
    assert sorted(error.headers) == sorted(HEADERS)
    assert error.headers["x-ratelimit-reset-tokens"] == "0s", "nothing charged: the window is whole"


def test_the_limit_that_holds_the_request_longest_refuses_it(clock: list[float]) -> None:
    metrics = GuardMetrics()
    acme = tenant(rpm=2, tpm=100)
    limiter = RateLimiter([acme], metrics)
    charge_now(limiter, acme, 0)
    clock[0] = 1010.5
    charge_now(limiter, acme, 0).settle(100)  # a surplus counts from its charge's second: the tokens of 1010
    clock[0] = 1020.0
    error = refused(limiter, acme, 1)
    assert "tpm" in error.message and error.retry_after == 1071 - 1020, "not the requests of 1000 (41 s)"
    assert metrics.ratelimit_rejections.labels("acme", "tokens")._value.get() == 1
    assert metrics.ratelimit_rejections.labels("acme", "requests")._value.get() == 0


def test_a_guard_deciding_alone_keeps_to_its_share(clock: list[float]) -> None:
    """``charge_here`` with ``guards``: the shared limiter's fallback while Redis is down (guard/state/limits.py)."""
    acme = tenant(rpm=5, tpm=1000)
    limiter = RateLimiter([acme], GuardMetrics())
    assert [limiter.charge_here(acme, 100, guards=2) is not None for _ in range(2)] == [True, True]
    with pytest.raises(GuardError) as info:  # 5 // 2: two requests a minute for each of two guards
        limiter.charge_here(acme, 100, guards=2)
    assert info.value.retry_after == 60 and "admits 1/2 of the limit" in info.value.message
    assert info.value.headers is not None and info.value.headers["x-ratelimit-remaining-requests"] == "0"
    assert info.value.headers["x-ratelimit-remaining-tokens"] == "300", "of its share, 500"
    clock[0] += WINDOW_S + 1
    with pytest.raises(GuardError) as info:  # fits the limit, never this guard's share: ask again soon
        limiter.charge_here(acme, 600, guards=2)
    assert info.value.retry_after == 1 and "retrying will not help" not in info.value.message
    charge = limiter.charge_here(acme, 400, guards=2)
    assert charge is not None and charge.headers()["x-ratelimit-remaining-tokens"] == "100"
    assert sorted(limiter.local_levels(2)) == [("acme", "requests", 5, 1), ("acme", "tokens", 1000, 100)]


def test_configure_keeps_what_the_windows_hold(clock: list[float]) -> None:
    limiter = RateLimiter([tenant(tpm=1000)], GuardMetrics())
    charge = charge_now(limiter, tenant(tpm=1000), 800)
    limiter.configure([tenant(tpm=900, rpm=2)])
    assert sorted(limiter.levels()) == [("acme", "requests", 2, 2), ("acme", "tokens", 900, 100)]
    limiter.configure([tenant()])
    assert list(limiter.levels()) == [] and charge_now(limiter, tenant(), 10**6) is None
    charge.settle(10)  # on the window it was charged on, which no longer limits anyone


@pytest.mark.parametrize(("seconds", "text"), [(0, "0s"), (-1, "0s"), (0.12, "120ms"), (0.0001, "1ms"),
                                               (6, "6s"), (6.5, "6.5s"), (59.9986, "59.999s"), (59.9994, "1m0s"), (60, "1m0s"),
                                               (61.25, "1m1.25s")])
def test_reset_durations_are_openais(seconds: float, text: str) -> None:
    assert duration(seconds) == text


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["charge", "settle", "wait"]), st.integers(0, 700)), max_size=60))
def test_no_drift(ops: list[tuple[str, int]]) -> None:
    """Whatever is charged and settled, in whatever order and time: the windows hold exactly their entries,
    admission never passes a limit, and once everything is settled and a window has passed, nothing is held."""
    now = [500.0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("guard.admission.limits.time", SimpleNamespace(monotonic=lambda: now[0]))
        acme = tenant(rpm=7, tpm=1500)
        limiter = RateLimiter([acme], GuardMetrics())
        windows = limiter.limited["acme"].windows
        open_charges = []
        for op, n in ops:
            if op == "charge":
                for window in windows.values():
                    window.expire(int(now[0]))
                before = {kind: window.used for kind, window in windows.items()}
                try:
                    open_charges.append(charge_now(limiter, acme, n))
                except GuardError:
                    continue
                assert before["requests"] + 1 <= 7 and before["tokens"] + n <= 1500
            elif op == "settle" and open_charges:
                open_charges.pop(n % len(open_charges)).settle(None if n % 5 == 0 else n)
            else:
                now[0] += n / 20
            for window in windows.values():
                assert window.used == sum(amount for _, amount in window.entries)
                assert all(amount >= 0 for _, amount in window.entries)
        for charge in open_charges:
            charge.settle(n)
        now[0] += WINDOW_S + 1
        assert [left for *_, left in limiter.levels()] == [7, 1500]


# -- the real guard in front of the tiny engine ----------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    with ServerThread(num_blocks=256) as server:
        yield server


@pytest.fixture(scope="module", params=BACKENDS)
def guard(request: pytest.FixtureRequest, engine, redis: RedisServer):
    tenants = [{"name": "acme", "api_keys": ["sk-acme"], "rpm": 20},
               {"name": "globex", "api_keys": ["sk-globex"]},
               {"name": "burst", "api_keys": ["sk-burst"], "tpm": 2000},
               {"name": "settle", "api_keys": ["sk-settle"], "tpm": 10000}]
    shared = {"shared_state": {"redis_url": redis.url}} if request.param == "redis" else {}
    with usable_guard(guard_config(engine.url, tenants=tenants, **shared)) as g:
        if shared:
            wait_for(lambda: g.call(lambda: g.state.shared.up), bool, 10)
        yield g


def post(guard: GuardThread, key: str, **body) -> tuple[int, dict[str, str], dict]:
    """A completion as the tenant of ``key``: status, headers (lower-case names) and the JSON body."""
    req = urllib.request.Request(guard.url + "/v1/completions", data=json.dumps({"model": "tiny", **body}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, json.loads(error.read())


def metric(guard: GuardThread, name: str, **labels: str) -> float:
    _, body = request(guard.url + "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()))


def test_rpm_20_admits_20_of_40_quick_requests(guard: GuardThread) -> None:
    answers = [post(guard, "sk-acme", prompt="quick", max_tokens=1) for _ in range(40)]
    assert [status for status, _, _ in answers] == [200] * 20 + [429] * 20
    for i, (_, headers, _) in enumerate(answers[:20]):
        assert headers["x-ratelimit-limit-requests"] == "20"
        assert headers["x-ratelimit-remaining-requests"] == str(19 - i)
        assert "x-ratelimit-limit-tokens" not in headers, "acme has no tpm"
    for _, headers, body in answers[20:]:
        assert 1 <= int(headers["retry-after"]) <= 60
        assert headers["x-ratelimit-remaining-requests"] == "0" and headers["x-ratelimit-reset-requests"].endswith("s")
        assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "rate_limit_error"
        assert "rpm limit of 20 requests per minute" in body["error"]["message"]
    sdk = openai.OpenAI(base_url=guard.url + "/v1", api_key="sk-acme", max_retries=0)
    with pytest.raises(openai.RateLimitError) as info:
        sdk.completions.create(model="tiny", prompt="quick", max_tokens=1)
    assert info.value.code == "rate_limit_exceeded" and 1 <= int(info.value.response.headers["retry-after"]) <= 60
    assert metric(guard, "guard_ratelimit_rejections_total", tenant="acme", kind="requests") == 21
    assert metric(guard, "guard_requests_total", tenant="acme", outcome="rejected_quota") == 21
    assert metric(guard, "guard_ratelimit_limit", tenant="acme", kind="requests") == 20
    assert metric(guard, "guard_ratelimit_remaining", tenant="acme", kind="requests") == 0

    raw = openai.OpenAI(base_url=guard.url + "/v1", api_key="sk-globex").completions.with_raw_response.create(
        model="tiny", prompt="quick", max_tokens=1)
    assert raw.http_response.status_code == 200
    assert not [h for h in raw.headers if h.lower().startswith("x-ratelimit")], "globex has no limits"


def test_tpm_2000_admits_5_of_20_concurrent_400_token_requests(guard: GuardThread) -> None:
    prompt = "x" * 300
    _, _, probe = post(guard, "sk-globex", prompt=prompt, max_tokens=1)
    max_tokens = 400 - probe["usage"]["prompt_tokens"]  # each charged exactly 400: prompt + max output

    async def fire() -> list[tuple[int, dict[str, str], dict]]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-burst"}) as session:
            async def one() -> tuple[int, dict[str, str], dict]:
                async with session.post(guard.url + "/v1/completions", json=body) as r:
                    return r.status, {k.lower(): v for k, v in r.headers.items()}, await r.json()
            return await asyncio.gather(*(one() for _ in range(20)))

    answers = asyncio.run(fire())
    admitted = [a for a in answers if a[0] == 200]
    assert len(admitted) == 5, [a[0] for a in answers]
    assert all(a[2]["usage"]["total_tokens"] == 400 for a in admitted)
    left = [int(h["x-ratelimit-remaining-tokens"]) for _, h, _ in admitted]  # as each answer started
    assert min(left) == 0 and set(left) <= {0, 400, 800, 1200, 1600}, left
    for status, headers, body in answers:
        if status != 200:
            assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
            assert "tpm limit of 2000 tokens per minute" in body["error"]["message"]
            assert 1 <= int(headers["retry-after"]) <= 60
            assert headers["x-ratelimit-limit-tokens"] == "2000" and headers["x-ratelimit-remaining-tokens"] == "0"
    assert metric(guard, "guard_ratelimit_rejections_total", tenant="burst", kind="tokens") == 15


def test_a_charge_settles_to_what_the_request_used(guard: GuardThread) -> None:
    def remaining() -> float:
        return metric(guard, "guard_ratelimit_remaining", tenant="settle", kind="tokens")

    status, headers, first = post(guard, "sk-settle", prompt="settle me", max_tokens=200)
    assert status == 200
    prompt = first["usage"]["prompt_tokens"]
    assert int(headers["x-ratelimit-remaining-tokens"]) == 10000 - prompt - 200, "charged prompt + max_tokens"
    used = first["usage"]["total_tokens"]  # settled to this, whether the model stopped early or not
    _, headers, second = post(guard, "sk-settle", prompt="settle me", max_tokens=5)
    assert int(headers["x-ratelimit-remaining-tokens"]) == 10000 - used - (prompt + 5)
    # A unary answer's charge is settled before the answer is sent.
    assert remaining() == 10000 - used - second["usage"]["total_tokens"]

    # A stream is stamped before it starts; a client that leaves early is charged only what it was sent.
    async def leave_early() -> dict[str, str]:
        body = {"model": "tiny", "prompt": "settle me", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        async with (aiohttp.ClientSession(headers={"Authorization": "Bearer sk-settle"}) as session,
                    session.post(guard.url + "/v1/completions", json=body) as r):
            await r.content.readline()
            return {k.lower(): v for k, v in r.headers.items()}

    before = remaining()
    stamped = asyncio.run(leave_early())
    assert int(stamped["x-ratelimit-remaining-tokens"]) == before - prompt - 1500
    after = wait_for(remaining, lambda left: left > before - prompt - 1500, 10)
    assert after >= before - prompt - 1000, "most of the 1500 output tokens were never produced"
