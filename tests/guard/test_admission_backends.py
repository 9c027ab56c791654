"""One admission core, two state backends: the same arrivals, first tokens and ends driven through a guard
that decides alone and through guards that decide in a real Redis (guard/state/ledger.py) get the same
decisions, request by request: admitted on the same replica with the same blocks borrowed, queued, or
refused with the same code (tests/support/admission_backends.py, on a fake clock so that both are judged
at the same instants).

- an SLO scenario (a critical lane beside a sheddable flood, as the issue measured it): the flood's
  requests that no replica can serve in time are shed, the critical ones reclaim what the flood borrowed
  and go first, with two guards on Redis exactly as with one guard;
- a TPOT objective: a replica whose decode batch would break it is held back; a sheddable request that
  every replica would break is refused;
- a property: random arrivals, first tokens and ends of three tenants in three classes, one guard per
  backend, the same decisions.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.admission_backends import BACKENDS, FakeClock, Script, admission, flush
from support.admission_parts import snapshot
from support.redis_server import RedisServer

from guard.config import GuardConfig

CONFIG = GuardConfig.model_validate({
    "engines": [{"name": "e0", "url": "http://127.0.0.1:9000"}, {"name": "e1", "url": "http://127.0.0.1:9001"}],
    "secret": "s",
    "lanes": {
        "live": {"priority": 0, "priority_class": "critical", "slo": {"ttft_ms": 1500}},
        "chat": {"priority": 1, "priority_class": "standard", "slo": {"ttft_ms": 3000}},
        "flood": {"priority": 2, "priority_class": "sheddable", "slo": {"ttft_ms": 1000}},
    },
    "tenants": [{"name": "crit", "api_keys": ["sk-c"], "weight": 1, "lane": "live"},
                {"name": "std", "api_keys": ["sk-s"], "weight": 2, "lane": "chat"},
                {"name": "bulk", "api_keys": ["sk-b"], "weight": 19, "lane": "flood"}]})
BLOCKS = (96, 80)  # budgets 81 and 68: distinct, so that the scorers never tie between the replicas


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    clock = FakeClock()
    clock.install(monkeypatch)
    return clock


async def slo_scenario(script: Script) -> None:
    """A sheddable flood (weight 19) fills both replicas and queues, its pace learned from its ends; a
    critical tenant (weight 1) arrives throughout; the flood's later arrivals would wait past their 1 s."""
    for _ in range(4):  # each replica's latency model learns a first token of about 0.3 s
        rid = await script.arrive(2, 8)
        await script.first_token(rid, 0.3)
    for _ in range(20):
        await script.arrive(2, 8)
        script.tick(0.05)
    for round_ in range(6):
        for rid in script.running()[:3]:
            await script.end(rid, 32)
            script.tick(0.2)
        await script.arrive(0, 6)
        await script.arrive(2, 8)
        await script.arrive(2, 8)
        script.tick(0.1 * round_)


async def run_slo(backend: str, clock: FakeClock, redis_url: str | None, guards: int) -> list[tuple]:
    async with admission(backend, CONFIG, BLOCKS, redis_url, guards=guards) as dispatchers:
        script = Script(dispatchers[0], clock)  # every request reaches the first guard; the others are live
        try:
            await slo_scenario(script)
        finally:
            await script.close()
        return script.decisions


@pytest.mark.parametrize("backend", BACKENDS)
async def test_the_slo_scenario_sheds_the_flood_and_serves_the_critical_lane(
        backend: str, redis: RedisServer, clock: FakeClock) -> None:
    flush(redis)
    decisions = await run_slo(backend, clock, redis.url, 1)
    assert "slo_unattainable" in [d[1] for d in decisions], "the flood's late arrivals are shed"
    assert {d[2] for d in decisions if d[1] == "admitted"} == {"e0", "e1"}, "placed on both replicas"
    critical = {f"r{n}" for n in range(24, 42, 3)}  # (slo_scenario: each round's first arrival)
    admitted = [d for d in decisions if d[0] in critical and d[1] == "admitted"]
    assert len(admitted) == 6 and all(d[3] == 0 for d in admitted), \
        "every critical request admitted at once, borrowing nothing, while the flood queues"


async def test_an_slo_lane_sheds_and_places_with_two_guards_on_redis_as_with_one_guard(
        redis: RedisServer, clock: FakeClock) -> None:
    flush(redis)
    start = clock.now
    alone = await run_slo("local", clock, None, 1)
    clock.now = start
    shared = await run_slo("redis", clock, redis.url, 2)
    assert "slo_unattainable" in [d[1] for d in alone]
    assert shared == alone


def decode_steps(dispatcher, lines: dict[str, tuple[float, float]], running: int) -> None:
    """Each replica's telemetry: its decode step ``base + per_sequence x batch`` (``lines[name]``) at
    batches 1 to 8, then ``running`` sequences there that are not this guard's (another guard's, say)."""
    for replica, blocks in zip(dispatcher.pool.replicas, BLOCKS, strict=True):
        base, per_sequence = lines[replica.name]
        for batch in (*range(1, 9), running):
            replica.on_snapshot(snapshot(num_blocks=blocks, free=blocks).model_copy(
                update={"num_running": batch, "itl_s": base + per_sequence * batch}))


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_tpot_objective_keeps_a_request_off_a_replica_whose_decode_batch_would_break_it(
        backend: str, redis: RedisServer, clock: FakeClock) -> None:
    """e0, the replica the scorers prefer (more blocks), decodes at 6 ms + 3 ms a sequence; e1 at 2 ms + 1 ms.
    With 4 sequences on each, a stream joining e0 would see ~21 ms per token, e1 ~7 ms."""
    flush(redis)
    async with admission(backend, CONFIG, BLOCKS, redis.url) as (dispatcher,):
        decode_steps(dispatcher, {"e0": (0.006, 0.003), "e1": (0.002, 0.001)}, running=4)
        script = Script(dispatcher, clock)
        try:
            unhurried = await script.arrive(0, 4)
            await script.end(unhurried, 8)
            hurried = await script.arrive(0, 4, headers={"X-SLO-TPOT-Ms": "15"})
            hopeless = await script.arrive(2, 4, headers={"X-SLO-TPOT-Ms": "5"})
            modest = await script.arrive(2, 4, headers={"X-SLO-TPOT-Ms": "30"})
        finally:
            await script.close()
    outcomes = {d[0]: d[1:] for d in script.decisions if d[1] != "ended"}
    assert outcomes[unhurried][:2] == ("admitted", "e0"), "without a TPOT objective, the scorers' choice"
    assert outcomes[hurried][:2] == ("admitted", "e1"), "e0's decode batch would break 15 ms a token"
    assert script.tickets[hurried].predicted_tpot == pytest.approx(0.002 + 0.001 * 5, rel=0.02)
    assert outcomes[hopeless] == ("slo_unattainable",), "a sheddable request no replica decodes fast enough for"
    assert outcomes[modest][0] == "admitted"


OPS = st.lists(st.one_of(
    st.tuples(st.just("arrive"), st.integers(0, 2), st.integers(1, 24)),
    st.tuples(st.just("end"), st.integers(0, 7), st.integers(0, 64)),
    st.tuples(st.just("first"), st.integers(0, 7), st.floats(0.05, 2.0)),
    st.tuples(st.just("tick"), st.floats(0.0, 0.5)),
), min_size=5, max_size=40)


async def run_ops(backend: str, clock: FakeClock, redis_url: str | None, ops: list[tuple]) -> list[tuple]:
    async with admission(backend, CONFIG, BLOCKS, redis_url) as (dispatcher,):
        script = Script(dispatcher, clock)
        try:
            for op in ops:
                running = script.running()
                if op[0] == "arrive":
                    await script.arrive(op[1], op[2])
                elif op[0] == "end" and running:
                    await script.end(running[op[1] % len(running)], op[2])
                elif op[0] == "first" and running:
                    await script.first_token(running[op[1] % len(running)], op[2])
                elif op[0] == "tick":
                    script.tick(op[1])
        finally:
            await script.close()
        return script.decisions


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_random_arrivals_and_ends_get_the_same_decisions_on_both_backends(
        redis: RedisServer, clock: FakeClock, ops: list[tuple]) -> None:
    flush(redis)
    start = clock.now
    alone = asyncio.run(run_ops("local", clock, None, ops))
    clock.now = start
    shared = asyncio.run(run_ops("redis", clock, redis.url, ops))
    assert shared == alone, ops
