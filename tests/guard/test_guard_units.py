"""The guard's pure parts: config validation, keys, VTC fairness, the admission gate and the dispatcher."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import ROOT
from support.admission_parts import BASE, make_dispatcher, snapshot, ticket, write

from guard.admission.fairness import FairQueue
from guard.admission.ticket import Ticket, TicketState
from guard.auth import KeyStore
from guard.config import Admission, ConfigError, GuardConfig, load_config
from guard.errors import GuardError
from guard.instance import STATE
from guard.pool.gate import AdmissionGate, batch_blocks_for, blocks_for
from guard.server.app import create_app


def test_example_config_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGUARD_SECRET", "from-the-environment")  # the file leaves it out, as it should
    config = load_config(ROOT / "guard.example.yaml")
    assert config.secret == "from-the-environment"
    assert [t.name for t in config.tenants] == ["acme", "globex", "bulk"]
    assert config.admission.safe_utilization == 0.85


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (BASE + "admission: {safe_utilisation: 0.9}\n", "admission.safe_utilisation: unknown key 'safe_utilisation'"),
        (BASE + "bogus: 1\n", "bogus: unknown key 'bogus'"),
        (BASE.replace("weight: 2", "weight: heavy"), "tenants.0.weight"),
        (BASE + "engine: {url: http://other}\n", "duplicate key 'engine'"),
        (BASE + "  - {name: acme, api_keys: [sk-c]}\n", "duplicate tenant name(s): acme"),
        (BASE.replace("sk-b", "sk-a"), "an API key is listed more than once"),
        (BASE.replace("lane: batch", "lane: turbo"), "unknown lane 'turbo'"),
        ("tenants: []\n", "tenants: List should have at least 1 item"),
        ("secret: s\ntenants: [{name: a, api_keys: [k]}]\n", "give either engine (one replica) or engines"),
        ("- just a list\n", "expected a mapping"),
        (BASE + "admission: {safe_utilization: 0.5, resume_utilization: 0.7}\n", "resume_utilization"),
    ],
)
def test_invalid_config_names_the_problem(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and expected in str(info.value)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")


def test_keys_map_to_tenants_and_digests_work(tmp_path: Path) -> None:
    digest = hashlib.sha256(b"sk-hashed").hexdigest()
    config = load_config(write(tmp_path, BASE + f"  - {{name: hashed, api_key_sha256: ['{digest}']}}\n"))
    keys = KeyStore(config.tenants, "s3cret")
    assert keys.tenant_for("Bearer sk-a").name == "acme"
    assert keys.tenant_for("bearer   sk-b ").name == "bulk"
    assert keys.tenant_for("Bearer sk-hashed").name == "hashed"
    for bad in (None, "", "Bearer", "Bearer ", "Basic sk-a", "sk-a", "Bearer sk-x"):
        assert keys.tenant_for(bad) is None
    salts = {keys.cache_salt(t) for t in config.tenants}
    assert len(salts) == 3 and keys.cache_salt(config.tenants[0]) == KeyStore(config.tenants, "s3cret").cache_salt(
        config.tenants[0])
    assert KeyStore(config.tenants, "other").cache_salt(config.tenants[0]) != keys.cache_salt(config.tenants[0])


def test_vtc_shares_service_by_weight_and_idle_banks_no_credit() -> None:
    fair: FairQueue[int] = FairQueue()
    tenants = [fair.tenant("a", 1), fair.tenant("b", 2), fair.tenant("c", 1)]
    for t in tenants:
        for i in range(400):
            fair.push(t, 0, i)
    served = {"a": 0, "b": 0, "c": 0}
    for _ in range(400):
        t = fair.next_tenant()
        fair.pop(t)
        fair.charge(t, input_tokens=10, output_tokens=20)
        served[t.name] += 1
    assert served["b"] == pytest.approx(2 * served["a"], abs=2) and served["a"] == pytest.approx(served["c"], abs=1)
    assert fair.jain_index() > 0.99
    late = fair.tenant("late", 1)
    fair.push(late, 0, 0)
    assert late.counter == min(t.counter for t in tenants), "a returning tenant is lifted to the backlog's minimum"


def test_lanes_order_work_inside_a_tenant() -> None:
    fair: FairQueue[str] = FairQueue()
    t = fair.tenant("a", 1)
    fair.push(t, 4, "batch-1")
    fair.push(t, 1, "interactive-1")
    fair.push(t, 4, "batch-2")
    assert [fair.pop(t) for _ in range(3)] == ["interactive-1", "batch-1", "batch-2"]


def test_gate_commits_against_live_usage_with_hysteresis() -> None:
    gate = AdmissionGate(Admission(safe_utilization=0.8, resume_utilization=0.5), {"acme"})
    assert not gate.try_reserve("r0", "acme", 1), "no telemetry: the pool counts as full"
    gate.update(snapshot(free=90))  # 10 blocks used by someone the guard does not know
    assert blocks_for(16, prompt_tokens=20, max_tokens=30) == 4
    assert blocks_for(16, prompt_tokens=20, max_tokens=30, n=3) == 4 + 2 * 3
    assert batch_blocks_for(16, [20, 20, 5], max_tokens=30) == 4 + 4 + 3
    assert gate.try_reserve("r1", "acme", 60) and gate.committed() == 70
    assert not gate.try_reserve("r2", "acme", 20), "70 + 20 > 80"
    assert not gate.open
    assert not gate.try_reserve("r2", "acme", 5), "closed: only below resume_utilization (50)"
    gate.update(snapshot(free=40, acme=50))  # acme's blocks are covered by its reservation
    assert gate.committed() == 70
    gate.update(snapshot(free=10, cached=30, acme=50))  # cached blocks are reclaimable: nobody's use
    assert gate.outside == 10 and gate.committed() == 70
    assert gate.release("r1") and not gate.release("r1")
    assert gate.try_reserve("r2", "acme", 20) and gate.open
    gate.received_at -= 10
    assert not gate.try_reserve("r3", "acme", 1), "stale telemetry counts as full"


def test_drain_rate_counts_only_the_window_and_only_its_busy_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("guard.pool.gate.time", SimpleNamespace(monotonic=lambda: clock[0]))
    gate = AdmissionGate(Admission(), {"acme"})
    for i, blocks in enumerate((3, 4, 5)):  # held 1 s each, from 1000, 1004 and 1008; idle between
        clock[0] = 1000.0 + 4 * i
        gate.update(snapshot(free=100))
        assert gate.try_reserve(f"r{i}", "acme", blocks)
        clock[0] += 1.0
        assert gate.release(f"r{i}")
    clock[0] = 1009.0
    assert gate.drain_rate() == pytest.approx(12 / 3), "3 busy seconds: the 6 idle ones drained nothing"
    clock[0] = 1012.0
    assert gate.drain_rate() == pytest.approx(9 / 2), "the first request left the 10 s window"
    clock[0] = 1030.0
    assert gate.drain_rate() == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "release"]), st.integers(0, 9), st.integers(1, 40)),
                max_size=80))
def test_reservations_are_never_leaked(ops: list[tuple[str, int, int]]) -> None:
    gate = AdmissionGate(Admission(), {"t0", "t1"})
    gate.update(snapshot(num_blocks=200, free=200))
    model: dict[str, int] = {}
    for op, key, blocks in ops:
        name = f"r{key}"
        if op == "reserve" and name not in model:
            if gate.try_reserve(name, f"t{key % 2}", blocks):
                model[name] = blocks
        elif op == "release":
            assert gate.release(name) == (name in model)
            model.pop(name, None)
        assert sum(gate.reserved_by_tenant.values()) == sum(model.values()) <= gate.budget
    for name in list(model):
        gate.release(name)
    assert not gate.reservations and not gate.reserved_by_tenant


async def test_dispatcher_admits_queues_times_out_and_cancels(tmp_path: Path) -> None:
    dispatcher, config = make_dispatcher(tmp_path)  # budget 85 blocks
    big = ticket(config, 0, 80, "big")
    await dispatcher.submit(big)
    assert big.state is TicketState.ADMITTED
    late = ticket(config, 0, 10, "late", timeout=0.05)
    with pytest.raises(GuardError) as info:
        await dispatcher.submit(late)
    assert info.value.status == 503 and 1 <= info.value.retry_after <= 60
    waiting = ticket(config, 0, 10, "waiting")  # past acme's guarantee, as big is: it waits for idle room
    task = asyncio.create_task(dispatcher.submit(waiting))
    await asyncio.sleep(0.01)
    assert waiting.state is TicketState.QUEUED
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert waiting.state is TicketState.DONE and len(dispatcher.queue_of(config.tenants[0])) == 0
    queued = [ticket(config, 0, 10, f"q{i}") for i in range(3)]
    tasks = [asyncio.create_task(dispatcher.submit(t)) for t in queued]
    await asyncio.sleep(0.01)
    with pytest.raises(GuardError) as info:
        await dispatcher.submit(ticket(config, 0, 1, "overflow"))
    assert info.value.status == 429 and info.value.code == "queue_full"
    dispatcher.finish(big)
    await asyncio.gather(*tasks)
    for t in queued:
        dispatcher.finish(t)
    assert not dispatcher.pool.reservations()


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(1, 60), st.sampled_from(["finish", "cancel", "hold"])),
                min_size=1, max_size=25))
def test_dispatcher_never_leaks_a_reservation(tmp_path_factory, plan) -> None:
    async def scenario() -> None:
        dispatcher, config = make_dispatcher(tmp_path_factory.mktemp("d"))
        tickets, tasks = [], []
        for i, (tenant, blocks, _) in enumerate(plan):
            t = ticket(config, tenant, blocks, f"r{i}", timeout=0.2)
            tickets.append(t)
            tasks.append(asyncio.create_task(dispatcher.submit(t)))
        await asyncio.sleep(0)
        for (_, _, action), t, task in zip(plan, tickets, tasks):
            if action == "cancel":
                task.cancel()
            elif action == "finish" and t.state is TicketState.ADMITTED:
                dispatcher.finish(t)
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in tickets:
            dispatcher.finish(t)
        assert not dispatcher.pool.reservations() and not dispatcher.pool.reserved_by_tenant()
        assert all(len(q) == 0 for q in dispatcher.fair.tenants.values())

    asyncio.run(scenario())


async def test_another_tenants_backlog_does_not_get_a_newcomer_refused(tmp_path: Path) -> None:
    dispatcher, config = make_dispatcher(tmp_path)  # budget 85 blocks
    gate = dispatcher.pool.replicas[0].gate
    assert gate.try_reserve("done", "bulk", 10) and gate.release("done")  # a slow measured drain rate
    hog = ticket(config, 1, 80, "hog")
    await dispatcher.submit(hog)
    backlog = [asyncio.create_task(dispatcher.submit(ticket(config, 1, 80, f"b{i}"))) for i in range(20)]
    await asyncio.sleep(0.01)
    # 1,600 blocks of bulk's backlog would take minutes to drain, but VTC serves acme first: it must queue
    # (60 blocks are past acme's guarantee of 56, so they wait for idle room instead of reclaiming).
    newcomer = ticket(config, 0, 60, "newcomer")
    waiting = asyncio.create_task(dispatcher.submit(newcomer))
    await asyncio.sleep(0.01)
    assert newcomer.state is TicketState.QUEUED
    dispatcher.finish(hog)
    await waiting
    assert newcomer.state is TicketState.ADMITTED
    for task in backlog:
        task.cancel()
    await asyncio.gather(*backlog, return_exceptions=True)
    dispatcher.finish(newcomer)


async def test_a_tenants_queue_can_be_refused_alone(tmp_path: Path) -> None:
    """What a confirmed attacker had queued is refused; the other tenants' queues and admitted work stay."""
    dispatcher, config = make_dispatcher(tmp_path)  # budget 85 blocks
    hog = ticket(config, 1, 80, "hog")
    await dispatcher.submit(hog)
    attacker = [ticket(config, 1, 10, f"a{i}") for i in range(3)]
    bystander = ticket(config, 0, 60, "bystander")  # past its guarantee: it waits for idle room
    tasks = [asyncio.create_task(dispatcher.submit(t)) for t in (*attacker, bystander)]
    await asyncio.sleep(0.01)
    assert all(t.state is TicketState.QUEUED for t in (*attacker, bystander))
    refusal = GuardError(429, "attack", code="abuse_suspected", retry_after=60)
    assert dispatcher.reject_queued(config.tenants[1].name, refusal) == 3
    results = await asyncio.gather(*tasks[:3], return_exceptions=True)
    assert results == [refusal] * 3 and all(t.state is TicketState.DONE for t in attacker)
    assert hog.state is TicketState.ADMITTED and bystander.state is TicketState.QUEUED
    dispatcher.finish(hog)
    await tasks[3]
    assert bystander.state is TicketState.ADMITTED
    dispatcher.finish(bystander)
    assert not dispatcher.pool.reservations()


async def test_confirming_an_attacker_refuses_what_it_had_queued() -> None:
    """The guard's wiring, with the real detector: a tenant that probes, fills and squeezes against its cap
    is confirmed, and the requests it had queued get 429 ``abuse_suspected`` at once, not just later ones."""
    config = GuardConfig.model_validate({
        "engine": {"url": "http://127.0.0.1:9"}, "secret": "s",
        "tenants": [{"name": "attacker", "api_keys": ["sk-x"], "max_blocks_share": 0.5},
                    {"name": "victim", "api_keys": ["sk-v"], "weight": 2},
                    {"name": "another", "api_keys": ["sk-w"], "weight": 2}]})
    state = create_app(config)[STATE]
    state.pool.replicas[0].gate.update(snapshot(num_blocks=96, free=96))
    attacker = config.tenants[0]
    holding = Ticket("fill", attacker, config.lanes[attacker.lane], 10, 600, 40)
    await state.dispatcher.submit(holding)
    queued = [Ticket(f"q{i}", attacker, config.lanes[attacker.lane], 10, 600, 40) for i in range(2)]
    tasks = [asyncio.create_task(state.dispatcher.submit(t)) for t in queued]
    await asyncio.sleep(0.01)
    assert all(t.state is TicketState.QUEUED for t in queued), "held back by its own cap"
    start = time.monotonic() - 8.0
    for tick in range(160):  # the last 8 s: a probe every 0.25 s, a long generation every 2 s, 20 micro/s
        now = start + tick * 0.05
        for max_tokens in ([2] if tick % 5 == 0 else []) + ([600] if tick % 40 == 0 else []) + [8]:
            state.detector.on_request("attacker", max_tokens, now)
    state.escalation.evaluate()
    state.escalation.evaluate()
    assert state.detector.state("attacker") == "confirmed" and state.detector.state("victim") == "normal"
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        assert isinstance(result, GuardError) and (result.status, result.code) == (429, "abuse_suspected")
    assert holding.state is TicketState.ADMITTED and holding.revoked is not None, "what runs is told to end"
    assert holding.revoked.code == "abuse_suspected"
    state.dispatcher.finish(holding)
    assert not state.pool.reservations()
