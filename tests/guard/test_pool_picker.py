"""The replica picker and the dispatcher over a pool, on real gates fed with snapshots (no engines): which
replica each policy tries first, the saturation filter and its fail-open, spreading new conversations, and
one fair queue whose head goes to whichever replica can take it."""

from __future__ import annotations

import asyncio

import pytest
from support.admission_parts import POOL_CONFIG, pool_of

from engine.kv.hashing import extend_block_hashes
from guard.admission.dispatch import Dispatcher
from guard.admission.ticket import Ticket, TicketState
from guard.config import GuardConfig, Routing
from guard.pool.pool import ReplicaPool
from guard.pool.scheduling import Profile, Request, profile_for


def preset(policy: str) -> Profile:
    return profile_for(Routing(policy=policy))


def hashes(tokens: int, salt: str = "acme") -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, list(range(tokens)), 16, salt)
    return out


def first(picker: Profile, pool: ReplicaPool, blocks: int = 4, prompt: list[bytes] | None = None) -> str:
    return picker.rank(pool.replicas, Request(blocks, [prompt] if prompt else []))[0].replica.name


def test_round_robin_takes_turns_and_skips_an_open_circuit() -> None:
    pool, picker = pool_of([100, 100, 100]), preset("round_robin")
    assert sorted(first(picker, pool) for _ in range(3)) == ["e0", "e1", "e2"]
    pool.by_name["e1"].breaker.trip()
    assert {first(picker, pool) for _ in range(6)} == {"e0", "e2"}
    assert all(c.replica.name != "e1" for c in picker.rank(pool.replicas, Request(4, [])))


def test_least_loaded_prefers_fewest_in_flight() -> None:
    pool, picker = pool_of([100, 100, 100]), preset("least_loaded")
    pool.by_name["e0"].in_flight, pool.by_name["e1"].in_flight = 3, 1
    assert first(picker, pool) == "e2"
    pool.by_name["e2"].in_flight = 5
    assert first(picker, pool) == "e1"


def test_prefix_follows_the_cache_whatever_the_load() -> None:
    pool, picker = pool_of([100, 20, 100]), preset("prefix")
    prompt = hashes(160)  # 10 full blocks
    pool.by_name["e1"].index.reset(prompt[:6], 16)
    pool.by_name["e1"].in_flight = 9
    ranked = picker.rank(pool.replicas, Request(4, [prompt]))
    assert ranked[0].replica.name == "e1" and ranked[0].hit_blocks == 6


def test_kvguard_follows_the_cache_until_the_replica_is_saturated() -> None:
    picker = preset("kvguard")
    prompt = hashes(160)
    pool = pool_of([100, 100, 100])
    pool.by_name["e2"].index.reset(prompt[:8], 16)
    assert first(picker, pool, prompt=prompt) == "e2", "8 of 10 blocks cached: prefill saved wins"
    another = hashes(160, salt="bulk")  # the same tokens under another tenant's salt: nothing cached
    assert picker.rank(pool.replicas, Request(4, [another]))[0].hit_blocks == 0
    pool = pool_of([100, 100, 30])  # e2 would be past 80% of its budget after this request
    pool.by_name["e2"].index.reset(prompt[:8], 16)
    assert first(picker, pool, prompt=prompt) != "e2", "a saturated replica never wins on locality alone"
    pool = pool_of([30, 30, 30])  # all saturated: the filter fails open, the cache decides again
    pool.by_name["e2"].index.reset(prompt[:8], 16)
    assert first(picker, pool, prompt=prompt) == "e2"


def test_kvguard_does_not_pile_conversations_onto_a_busy_replica() -> None:
    """Cached system prompts attract a tenant's conversations; past the overload bound, load wins."""
    picker, prompt = preset("kvguard"), hashes(160)
    pool = pool_of([100, 100, 100])
    pool.by_name["e0"].index.reset(prompt[:6], 16)
    pool.by_name["e0"].in_flight, pool.by_name["e1"].in_flight, pool.by_name["e2"].in_flight = 3, 1, 1
    assert first(picker, pool, prompt=prompt) == "e0", "two more in flight: the cache still wins"
    pool.by_name["e0"].in_flight = 4
    assert first(picker, pool, prompt=prompt) != "e0", "four to one: balance first"


def test_kvguard_spreads_new_conversations() -> None:
    pool, picker = pool_of([100, 100, 100]), preset("kvguard")
    chosen = []
    for i in range(6):  # each new conversation goes somewhere and stays there (in flight)
        replica = picker.rank(pool.replicas, Request(4, [hashes(64, salt=f"t{i}")]))[0].replica
        replica.in_flight += 1
        chosen.append(replica.name)
    assert sorted(chosen) == ["e0", "e0", "e1", "e1", "e2", "e2"]


def test_kvguard_spreads_new_conversations_that_arrive_while_the_pool_is_idle() -> None:
    """Short requests, each finished before the next arrives: every new conversation finds an idle pool (an
    exact tie), and goes to the replica admitted to longest ago, whatever requests went between."""
    pool, picker = pool_of([100, 100, 100]), preset("kvguard")
    chosen = []
    for tenant in range(3):
        replica = picker.rank(pool.replicas, Request(4, [hashes(64, salt=f"t{tenant}")]))[0].replica
        chosen.append(replica.name)
        for _ in range(tenant + 2):  # its conversation's turns before the next tenant arrives (the rotation
            replica.admitted()  # would have moved on as many places)
            replica.finished()
            picker.rank(pool.replicas, Request(4, [hashes(64, salt=f"t{tenant}")]))
    assert sorted(chosen) == ["e0", "e1", "e2"]


async def test_one_fair_queue_feeds_whichever_replica_frees_first() -> None:
    pool = pool_of([100, 100], num_blocks=100)
    dispatcher = Dispatcher(POOL_CONFIG, pool, preset("kvguard"))
    acme, bulk = POOL_CONFIG.tenants

    def ticket(rid: str, tenant, blocks: int) -> Ticket:
        return Ticket(rid, tenant, POOL_CONFIG.lanes[tenant.lane], 10, 10, blocks)

    big = [ticket(f"big{i}", bulk, 80) for i in range(2)]
    for t in big:
        await dispatcher.submit(t)
    assert {t.replica.name for t in big} == {"e0", "e1"}, "one per replica: neither fits two"
    waiting = ticket("waiting", acme, 40)
    task = asyncio.create_task(dispatcher.submit(waiting))
    await asyncio.sleep(0.01)
    assert waiting.state is TicketState.QUEUED
    dispatcher.finish(big[1])
    await task
    assert waiting.state is TicketState.ADMITTED and waiting.replica is big[1].replica
    assert waiting.replica.in_flight == 1 and big[0].replica.in_flight == 1
    for t in (big[0], waiting):
        dispatcher.finish(t)
    assert not pool.reservations() and all(r.in_flight == 0 for r in pool)


def test_a_request_bigger_than_any_replica_is_measured_against_one_replica() -> None:
    pool = pool_of([100, 100, 100])
    assert pool.budget() == 3 * 85 and pool.largest_budget() == 85


@pytest.mark.parametrize("bad", [{"engine": {"url": "http://x:1"}, "engines": [{"name": "a", "url": "http://x:2"}]},
                                 {"engines": [{"url": "http://x:1"}, {"url": "http://x:2"}]}, {}])
def test_pool_config_errors_name_the_problem(bad: dict) -> None:
    with pytest.raises(ValueError, match="engine|unique"):
        GuardConfig.model_validate({**bad, "secret": "s", "tenants": [{"name": "a", "api_keys": ["k"]}]})
