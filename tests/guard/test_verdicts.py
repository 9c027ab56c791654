"""Fill-and-Squeeze verdicts on both state backends: a tenant the detector confirmed is refused (429
``abuse_suspected``) and every other tenant served, by the guard alone, and, with shared state, by every
guard, the one that did not confirm it included (guard/state/verdicts.py: adopted within a round)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator

import pytest
from support.admission_backends import BACKENDS, flush
from support.detector_script import squeeze
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config
from support.net import request
from support.redis_server import RedisServer
from support.wait import wait_for

from guard.detect.detector import Detector

TENANTS = [{"name": "a", "api_keys": ["sk-a"], "weight": 1}, {"name": "b", "api_keys": ["sk-b"], "weight": 2}]


@contextlib.contextmanager
def guards(backend: str, engine_url: str, redis: RedisServer) -> Iterator[list[GuardThread]]:
    """One guard alone, or two that share state, every link up."""
    if backend == "local":
        with GuardThread(guard_config(engine_url, tenants=TENANTS)) as guard:
            yield [guard]
        return
    flush(redis)
    shared = {"redis_url": redis.url}
    with GuardThread(guard_config(engine_url, tenants=TENANTS, shared_state=shared)) as g1, \
            GuardThread(guard_config(engine_url, tenants=TENANTS, shared_state=shared)) as g2:
        for guard in (g1, g2):
            wait_for(lambda g=guard: g.call(lambda: (g.state.shared.up, g.state.shared.live_guards)),
                     lambda seen: seen == (True, 2), 10)
        yield [g1, g2]


def confirm(detector: Detector, tenant: str) -> None:
    """The detector's verdict on 8 s of Fill-and-Squeeze by ``tenant``, holding 40 of 54 blocks with more
    of its requests queued: confirmed, on this guard's own evidence."""
    start = time.monotonic() - 8.0
    act = squeeze(detector, tenant)
    for tick in range(160):
        act(start + tick * 0.05)
    for _ in range(2):
        detector.evaluate({tenant: 40}, 54, {tenant}, 0.1)


def complete(url: str, key: str) -> tuple[int, bytes]:
    return request(url + "/v1/completions", json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 4,
                                                        "ignore_eos": True}).encode(),
                   {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_confirmed_tenant_is_refused_by_every_guard(backend: str, redis: RedisServer) -> None:
    with ServerThread(num_blocks=64) as engine, guards(backend, engine.url, redis) as fleet:
        first = fleet[0]
        first.call(lambda: confirm(first.state.detector, "a"))
        for guard in fleet:
            wait_for(lambda g=guard: g.call(lambda: g.state.detector.state("a")), lambda s: s == "confirmed", 5)
            status, body = complete(guard.url, "sk-a")
            assert status == 429 and json.loads(body)["error"]["code"] == "abuse_suspected"
            assert complete(guard.url, "sk-b")[0] == 200, "only the attacker"
