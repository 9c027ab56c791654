"""Classes and named objectives per request (guard/admission/classes.py), through a real guard in front of a
real tiny engine, on both state backends: ``X-Priority-Class`` within the tenant's ``priority_classes``
(403 outside them, 400 for no class), ``x-gateway-inference-objective`` selecting a named objective (400
when unknown), which ``X-Priority-Class`` may lower but not raise; and the request's class, not its lane's,
deciding admission (a sheddable request's blocks are lent, and it alone is shed for its objective)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import pytest
from support.admission_backends import BACKENDS, FakeClock, Script, admission, flush
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config
from support.net import request
from support.redis_server import RedisServer
from support.wait import wait_for

from guard.admission.classes import select
from guard.admission.ticket import TicketState
from guard.config import GuardConfig, Lane, Tenant
from guard.console.app import CONSOLE
from guard.errors import GuardError

OBJECTIVES = {"chat": {"priority_class": "critical", "slo": {"ttft_ms": 60000}},
              "offline": {"priority_class": "sheddable"}}
TENANTS = [{"name": "acme", "api_keys": ["sk-acme"], "lane": "interactive",
            "priority_classes": ["standard", "sheddable"], "objectives": OBJECTIVES},
           {"name": "plain", "api_keys": ["sk-plain"], "lane": "interactive"}]
LANES = {"interactive": {"priority": 1}}  # standard, no objective of its own
# For the admission core alone (tests/support/admission_backends.py): two replicas, no engines behind them.
BACKEND_CONFIG = GuardConfig.model_validate({
    "engines": [{"name": "e0", "url": "http://127.0.0.1:9000"}, {"name": "e1", "url": "http://127.0.0.1:9001"}],
    "secret": "s", "lanes": {"chat": {"priority": 1}, "other": {"priority": 2}},
    "tenants": [{"name": "idle", "api_keys": ["sk-i"], "lane": "other"},
                {"name": "std", "api_keys": ["sk-s"], "lane": "chat", "priority_classes": ["standard", "critical"]}]})
BACKEND_BLOCKS = (96, 80)


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerThread]:
    with ServerThread(num_blocks=128) as server:
        yield server


@contextlib.contextmanager
def guard_on(backend: str, engine: ServerThread, redis: RedisServer) -> Iterator[GuardThread]:
    extra = {}
    if backend == "redis":
        flush(redis)
        extra["shared_state"] = {"redis_url": redis.url}
    config = guard_config(engine.url, tenants=TENANTS, lanes=LANES, admin={"host": "127.0.0.1", "port": 0}, **extra)
    with GuardThread(config) as guard:
        wait_for(lambda: guard.call(guard.state.pool.any_usable), bool, 10)
        if backend == "redis":
            wait_for(lambda: guard.call(lambda: guard.state.shared.up), bool, 10)
        yield guard


def post(guard: GuardThread, key: str, rid: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    body = {"model": "tiny", "prompt": "which class am I?", "max_tokens": 4, "ignore_eos": True}
    status, raw = request(guard.url + "/v1/completions", json.dumps(body).encode(),
                          {"Authorization": f"Bearer {key}", "X-Request-Id": rid, **(headers or {})})
    return status, json.loads(raw)


def record(guard: GuardThread, rid: str) -> dict:
    status, raw = request(f"{guard.app[CONSOLE].url}/requests/{rid}")
    assert status == 200
    return json.loads(raw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_class_and_objective_headers_through_a_guard(backend: str, engine: ServerThread, redis: RedisServer) -> None:
    cases = [  # (request id, key, headers, status, error code or (class, objective) in its record)
        ("lane", "sk-acme", {}, 200, ("standard", None)),
        ("picked", "sk-acme", {"X-Priority-Class": "sheddable"}, 200, ("sheddable", None)),
        ("not-allowed", "sk-acme", {"X-Priority-Class": "critical"}, 403, "priority_class_not_allowed"),
        ("plain-lane-only", "sk-plain", {"X-Priority-Class": "sheddable"}, 403, "priority_class_not_allowed"),
        ("no-class", "sk-acme", {"X-Priority-Class": "urgent"}, 400, "invalid_priority_class"),
        ("chat", "sk-acme", {"x-gateway-inference-objective": "chat"}, 200, ("critical", "chat")),
        ("unknown", "sk-acme", {"x-gateway-inference-objective": "nope"}, 400, "unknown_objective"),
        ("lowered", "sk-acme", {"x-gateway-inference-objective": "chat", "X-Priority-Class": "sheddable"}, 200,
         ("sheddable", "chat")),
        ("raised", "sk-acme", {"x-gateway-inference-objective": "offline", "X-Priority-Class": "standard"}, 403,
         "priority_class_not_allowed"),
    ]
    with guard_on(backend, engine, redis) as guard:
        for rid, key, headers, status, expected in cases:
            got, body = post(guard, key, rid, headers)
            assert got == status, (rid, body)
            kept = record(guard, rid)
            if isinstance(expected, str):
                assert body["error"]["code"] == expected, rid
                param = body["error"]["param"]
                assert param == ("x-gateway-inference-objective" if expected == "unknown_objective"
                                 else "X-Priority-Class"), rid
                assert kept["shed"]["code"] == expected and kept["priority_class"] is None
                continue
            assert (kept["priority_class"], kept["objective"]) == expected, rid
            reservation = kept["reservation"]
            if expected[0] == "sheddable":  # a sheddable request's blocks are lent whole, whatever its lane
                assert reservation["borrowed"] == reservation["blocks"] > 0, rid
            else:
                assert reservation["borrowed"] == 0, rid
        chat = record(guard, "chat")["slo"]
        assert chat["ttft_ms"] == 60000 and chat["priority_class"] == "critical" and chat["met"] == {"ttft": True}
        status, raw = request(guard.url + "/metrics")
        metrics = raw.decode()
        assert ('guard_slo_requests_total{lane="interactive",met="true",objective="ttft",priority_class="critical"} 1.0'
                in metrics), "the objective's verdict counted under the request's class"


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_a_request_of_the_sheddable_class_is_shed(backend: str, engine: ServerThread, redis: RedisServer) -> None:
    """The same tenant, lane and objective: asked as sheddable, a request predicted late is refused at
    arrival; asked as standard (its lane's class), it is served."""
    tight = {"X-SLO-TTFT-Ms": "1"}  # no engine answers in 1 ms
    with guard_on(backend, engine, redis) as guard:
        for i in range(3):  # served; the pool drains, so a wait can be predicted
            assert post(guard, "sk-acme", f"warm-{i}")[0] == 200
        wait_for(lambda: guard.call(lambda: guard.state.pool.expected_wait(1)), lambda w: w is not None, 10)
        status, body = post(guard, "sk-acme", "shed", {**tight, "X-Priority-Class": "sheddable"})
        assert status == 503 and body["error"]["code"] == "slo_unattainable"
        assert record(guard, "shed")["priority_class"] == "sheddable"
        status, _ = post(guard, "sk-acme", "kept", tight)
        assert status == 200 and record(guard, "kept")["slo"]["met"] == {"ttft": False}


def test_select_rules_without_a_guard() -> None:
    """The rules alone, on the config's own objects: the default is the lane's class and objective."""
    lane = Lane(priority_class="standard", slo={"ttft_ms": 900})
    tenant = Tenant(name="t", api_keys=["k"], priority_classes=["sheddable", "standard"], objectives=OBJECTIVES)
    assert select(tenant, lane, {}) == ("standard", None, lane.slo)
    assert select(tenant, lane, {"X-Priority-Class": "sheddable"}).priority_class == "sheddable"
    chat = select(tenant, lane, {"x-gateway-inference-objective": "chat"})
    assert chat.priority_class == "critical" and chat.slo is not None and chat.slo.ttft_ms == 60000
    offline = select(tenant, lane, {"x-gateway-inference-objective": "offline"})
    assert offline == ("sheddable", "offline", None), "a named objective's slo replaces the lane's, even none"
    assert select(tenant, lane, {"x-gateway-inference-objective": "chat", "X-Priority-Class": "critical"}
                  ).priority_class == "critical", "asking for the objective's own class is no raise"
    lane_only = Tenant(name="u", api_keys=["k2"])
    with pytest.raises(GuardError) as refused:
        select(lane_only, lane, {"X-Priority-Class": "critical"})
    assert refused.value.status == 403
    assert select(lane_only, lane, {"X-Priority-Class": "standard"}).priority_class == "standard"


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    clock = FakeClock()
    clock.install(monkeypatch)
    return clock


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_critical_request_goes_before_its_own_tenants_standard_ones(
        backend: str, clock: FakeClock, redis: RedisServer) -> None:
    """A tenant whose lane is standard fills the pool and queues three more standard requests; its one
    critical request, arriving after them, is admitted first, on both backends (the class, not the lane,
    orders the tenant's queue: the critical band sees it at once)."""
    if backend == "redis":
        flush(redis)
    async with admission(backend, BACKEND_CONFIG, BACKEND_BLOCKS, redis.url) as (dispatcher,):
        script = Script(dispatcher, clock)
        try:
            filling = [await script.arrive(1, 8) for _ in range(18)]  # 144 of the 149 blocks' budget
            assert all(script.tickets[rid].state is TicketState.ADMITTED for rid in filling)
            queued = [await script.arrive(1, 8) for _ in range(3)]
            assert all(script.tickets[rid].state is TicketState.QUEUED for rid in queued)
            urgent = await script.arrive(1, 8, priority_class="critical")
            await script.end(filling[0], 4)
            await script.end(filling[1], 4)
            admitted = [d[0] for d in script.decisions if d[1] == "admitted" and d[0] not in filling]
            assert admitted and admitted[0] == urgent, script.decisions
            assert script.tickets[urgent].borrowed == 0, "a critical request never borrows"
        finally:
            await script.close()


# One replica of 100 blocks (budget 85): a batch tenant whose lines are sheddable, a client in the
# interactive lane (standard, 10 s queueing timeout), equal weights.
BESIDE_BATCH = GuardConfig.model_validate({
    "engine": {"name": "e0", "url": "http://127.0.0.1:9000"}, "secret": "s",
    "tenants": [{"name": "bulk", "api_keys": ["sk-b"], "lane": "batch"},
                {"name": "web", "api_keys": ["sk-w"], "lane": "interactive"}]})


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_standard_request_queues_behind_sheddable_lines_that_drain_instead_of_overloaded(
        backend: str, clock: FakeClock, redis: RedisServer) -> None:
    """Issue 44: after an idle spell a batch fills the budget with sheddable lines while the measured drain
    rate is still low (10 blocks released in the last 10 s: 1 block/s). A client's request that does not
    fit then waits for lent blocks that drain as the lines end (no line starts while it queues), so it is
    queued, not refused ``overloaded`` (the 20 blocks held past the budget at 1 block/s predicted 20 s
    against its 10 s timeout); and it is admitted only once a line's end leaves room in the pool, never past
    it."""
    if backend == "redis":
        flush(redis)
    async with admission(backend, BESIDE_BATCH, [100], redis.url) as (dispatcher,):
        script = Script(dispatcher, clock)
        try:
            script.tick(30.0)  # the idle spell
            lines = [await script.arrive(0, 5, priority_class="sheddable") for _ in range(17)]  # the budget
            script.tick(1.0)
            for rid in lines[:2]:  # two lines end and two more take their room, as the pacer refills
                await script.end(rid, 64)
            lines = lines[2:] + [await script.arrive(0, 5, priority_class="sheddable") for _ in range(2)]
            assert all(script.tickets[rid].state is TicketState.ADMITTED for rid in lines), script.decisions
            first = await script.arrive(1, 10)  # within its guarantee: reclaims lent blocks up to the pool
            assert script.tickets[first].state is TicketState.ADMITTED, script.decisions
            second = await script.arrive(1, 10)  # 95 + 10 > 100: it must wait for a line to end
            assert script.tickets[second].state is TicketState.QUEUED, script.decisions[-1]
            gate = dispatcher.pool.replicas[0].gate
            await script.end(lines[0], 64)
            assert script.tickets[second].state is TicketState.ADMITTED, script.decisions
            assert gate.reserved == 100 <= gate.snapshot.num_blocks, "admitted within the pool, not past it"
            assert dispatcher.sheddable_held == 16 * 5, "the sixteen lines still running"
        finally:
            await script.close()


# One replica of 100 blocks (budget 85), two tenants of one critical lane: a 1 s TTFT objective, 10 s to queue.
CRITICAL_LANE = GuardConfig.model_validate({
    "engine": {"name": "e0", "url": "http://127.0.0.1:9000"}, "secret": "s",
    "lanes": {"chat": {"priority": 1, "timeout": 10.0, "slo": {"ttft_ms": 1000}, "priority_class": "critical"}},
    "tenants": [{"name": "a", "api_keys": ["sk-a"], "lane": "chat"},
                {"name": "b", "api_keys": ["sk-b"], "lane": "chat"}]})


@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_critical_request_that_can_no_longer_be_on_time_yields_to_those_that_still_can(
        backend: str, clock: FakeClock, redis: RedisServer) -> None:
    """Served first come first, a critical queue that outgrows the replicas makes every request in it late.
    Tenant a fills the pool and queues two more that then wait past their 1 s objective; fresh requests of
    a and of b arrive after them. As room frees, the fresh ones go first (within a's queue and across the
    tenants' critical band), and the late ones are still served, in their order, with the room left, on
    both backends."""
    if backend == "redis":
        flush(redis)
    async with admission(backend, CRITICAL_LANE, [100], redis.url) as (dispatcher,):
        script = Script(dispatcher, clock)
        try:
            filling = [await script.arrive(0, 10) for _ in range(8)]  # 80 of the 85 blocks' budget
            late = [await script.arrive(0, 10) for _ in range(2)]
            assert all(script.tickets[rid].state is TicketState.QUEUED for rid in late), script.decisions
            script.tick(2.0)  # past their objective: they can no longer be on time
            fresh = [await script.arrive(0, 10), await script.arrive(1, 10)]
            for rid in filling[:4]:
                await script.end(rid, 4)
            admitted = [d[0] for d in script.decisions if d[1] == "admitted" and d[0] not in filling]
            assert sorted(admitted[:2]) == sorted(fresh) and admitted[2:] == late, script.decisions
            assert all(script.tickets[rid].late for rid in late) and not any(script.tickets[r].late for r in fresh)
        finally:
            await script.close()
