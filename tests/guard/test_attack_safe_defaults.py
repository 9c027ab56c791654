"""The attack-safe defaults end to end, real guard in front of the real tiny engine, no ``max_blocks_share``:
a tenant within its guarantee is admitted past borrowers, who run behind it in the engine, and a confirmed
attacker's running streams end at once with its error event, every block back."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
from support.engine_server import ServerThread
from support.guard_server import guard_config, usable_guard
from support.net import request
from support.wait import until, wait_for

from guard.instance import GuardState
from guard.pool.gate import BORROWED_PRIORITY

KEYS = {"acme": "sk-acme", "bulk": "sk-bulk", "globex": "sk-globex"}


async def stream(session: aiohttp.ClientSession, url: str, tenant: str, prompt: str, max_tokens: int,
                 first_token: asyncio.Event | None = None) -> list[dict]:
    """A streamed completion's events, ``[DONE]`` as ``{"done": True}``."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events: list[dict] = []
    async with session.post(url + "/v1/completions", json=body,
                            headers={"Authorization": f"Bearer {KEYS[tenant]}"}) as answer:
        assert answer.status == 200, await answer.text()
        async for line in answer.content:
            if line.startswith(b"data:"):
                data = line[5:].strip()
                events.append({"done": True} if data == b"[DONE]" else json.loads(data))
                if first_token is not None:
                    first_token.set()
    return events


async def telemetry(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(url + "/telemetry") as answer:
        return await answer.json()


def test_a_tenant_within_its_guarantee_reclaims_the_headroom_and_borrowers_run_behind_it() -> None:
    """40 blocks, a budget of 34: bulk (weight 1 of 4, guaranteed 8) borrows the rest of the budget for two
    generations (20 and 14 blocks), then acme (guaranteed 25) gets one of 6 blocks at once, in the headroom
    the budget keeps (34 + 6 = 40: the engine can still hold every reservation, so nobody is preempted). In
    the engine, bulk's requests run at the borrowed priority, behind acme's."""
    tenants = [{"name": "acme", "api_keys": ["sk-acme"], "weight": 3}, {"name": "bulk", "api_keys": ["sk-bulk"]}]
    with ServerThread(num_blocks=40) as engine, usable_guard(guard_config(engine.url, tenants=tenants)) as guard:
        priorities: dict[str, set[int]] = {}

        def read_priorities() -> None:
            # A copy of the engine thread's running list (atomic under the GIL), read while it steps.
            for seq in list(engine.core.scheduler.running):
                priorities.setdefault(seq.request.tenant, set()).add(seq.request.priority)

        async def scenario() -> None:
            async with aiohttp.ClientSession() as session:
                borrowers = [asyncio.create_task(stream(session, guard.url, "bulk", f"{i} bulk story", tokens))
                             for i, tokens in enumerate((300, 210))]
                await until(lambda: guard.call(lambda: guard.state.pool.tenant_reserved("bulk")),
                            lambda held: held == 34, 5)
                within = asyncio.create_task(stream(session, guard.url, "acme", "an acme story", 80))
                await until(lambda: guard.call(lambda: guard.state.pool.tenant_reserved("acme")), bool, 1)
                while not within.done():
                    read_priorities()
                    await asyncio.sleep(0.005)
                for events in await asyncio.gather(*borrowers, within):
                    assert events[-1] == {"done": True}

        asyncio.run(scenario())
        assert priorities["acme"] == {1} and priorities["bulk"] == {1 + BORROWED_PRIORITY}
        assert engine.telemetry()["preemptions_total"] == 0
        assert guard.call(lambda: not guard.state.pool.reservations())


def confirm(state: GuardState, tenant: str) -> None:
    """Feed the detector the last 8 s of a Fill-and-Squeeze (probes every 0.25 s, a long generation every
    2 s, 20 micro-requests a second) and evaluate: the verdict, and its consequences, as the guard's
    monitor would apply them."""
    start = time.monotonic() - 8.0
    for tick in range(160):
        now = start + tick * 0.05
        for max_tokens in ([2] if tick % 5 == 0 else []) + ([600] if tick % 40 == 0 else []) + [8]:
            state.detector.on_request(tenant, max_tokens, now)
    state.escalation.evaluate()
    state.escalation.evaluate()


def test_a_confirmed_attackers_running_streams_end_with_its_error_and_give_their_blocks_back() -> None:
    """128 blocks, a budget of 108: globex (guaranteed 27) borrows for three 500-token fills (32 blocks each)
    and its fourth waits for room, as an attacker's do at its edge. Confirmed, it loses all four."""
    with ServerThread(num_blocks=128) as engine, usable_guard(guard_config(engine.url)) as guard:

        async def scenario() -> None:
            async with aiohttp.ClientSession() as session:
                started = [asyncio.Event() for _ in range(3)]
                fills = [asyncio.create_task(stream(session, guard.url, "globex", f"{i} fill", 500, started[i]))
                         for i in range(3)]
                await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 10)
                waiting = asyncio.create_task(session.post(guard.url + "/v1/completions", json={
                    "model": "tiny", "prompt": "3 fill", "max_tokens": 500, "ignore_eos": True},
                    headers={"Authorization": "Bearer sk-globex"}))
                await until(lambda: guard.call(lambda: len(guard.state.dispatcher.fair.tenants["globex"])), bool, 5)
                bystander = asyncio.create_task(stream(session, guard.url, "acme", "a bystander", 300))
                guard.call(lambda: confirm(guard.state, "globex"))
                assert guard.call(lambda: guard.state.detector.state("globex")) == "confirmed"
                async with await waiting as refused:
                    assert refused.status == 429 and (await refused.json())["error"]["code"] == "abuse_suspected"
                for events in await asyncio.wait_for(asyncio.gather(*fills), 10):
                    assert {"done": True} not in events and len(events) < 1000, "ended long before 2,000 tokens"
                    assert events[-1]["error"]["code"] == "abuse_suspected"
                assert (await bystander)[-1] == {"done": True}, "another tenant's stream runs on"

        asyncio.run(scenario())
        wait_for(lambda: guard.call(lambda: guard.state.pool.reservations()), lambda held: not held, 5)
        snap = wait_for(lambda: json.loads(request(engine.url + "/telemetry")[1]),
                        lambda s: s["num_running"] == 0, 5)
        assert not snap["tenants"].get("globex", {}).get("blocks"), "the engine aborted them: their blocks are free"


def test_a_confirmed_attacker_is_refused_before_its_prompt_is_counted() -> None:
    """Its prompt is never tokenized: a prompt past the context window, which another tenant gets a 400 for,
    is a 429 for the confirmed tenant, whose arrival the detector still records."""
    with ServerThread(num_blocks=64) as engine, usable_guard(guard_config(engine.url)) as guard:
        guard.call(lambda: guard.state.escalation.adopt(["globex"]))  # as another guard's verdict arrives
        assert guard.call(lambda: guard.state.detector.state("globex")) == "confirmed"
        too_long = {"model": "tiny", "prompt": "x" * 100_000, "max_tokens": 4}
        status, body = request(guard.url + "/v1/completions", json.dumps(too_long).encode(),
                               headers={"Authorization": "Bearer sk-acme", "Content-Type": "application/json"})
        assert status == 400 and json.loads(body)["error"]["code"] == "context_length_exceeded", body
        sent_at = time.monotonic()
        status, body = request(guard.url + "/v1/completions", json.dumps(too_long).encode(),
                               headers={"Authorization": "Bearer sk-globex", "Content-Type": "application/json"})
        assert status == 429 and json.loads(body)["error"]["code"] == "abuse_suspected", body
        assert guard.call(lambda: guard.state.detector.tenants["globex"].probes[-1]) >= sent_at, "seen as a probe"
