"""Degraded-mode routing against real engines: the primary killed and restarted under traffic, and a
saturated (but healthy) primary pushing sheddable lanes to the fallback."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config, mode_transitions
from support.net import request
from support.processes import EngineProcess
from support.wait import wait_for

ROUTING = {"min_dwell_s": 1.0, "cooldown_s": 0.5, "health_interval_s": 0.2, "failure_threshold": 2}


async def stream_once(url: str, body: dict, key: str = "sk-acme", started: asyncio.Event | None = None
                      ) -> tuple[int, dict, bytes]:
    """One request; ``started`` is set once the first bytes of the answer have arrived."""
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", json=body,
                                                                 headers=headers) as r:
        data = await r.content.readany()
        if started is not None:
            started.set()
        return r.status, dict(r.headers), data + await r.read()


def test_engine_killed_then_restarted(tmp_path) -> None:
    primary = EngineProcess("--num-blocks", "512").start()
    try:
        with ServerThread(num_blocks=128) as fallback_engine, GuardThread(guard_config(
                primary.url, fallbacks=[{"name": "small", "url": fallback_engine.url}],
                routing=ROUTING, admission={"telemetry_stale_s": 3.0})) as guard:
            # Stale after 3 s, not 1: an idle engine refreshes its snapshot only every second (REFRESH_S), so
            # at 1 s a late refresh on a loaded machine took the primary for down and sent all three streams
            # to the fallback. The kill is noticed by the breaker (dropped streams, failed health checks).
            wait_for(lambda: guard.call(lambda: guard.state.modes.mode), lambda m: m == "normal", 15)
            long_stream = {"model": "tiny", "prompt": "long", "max_tokens": 1900, "stream": True,
                           "ignore_eos": True}

            async def scenario() -> tuple:
                started = [asyncio.Event() for _ in range(3)]
                in_flight = [asyncio.create_task(stream_once(guard.url, long_stream, started=e)) for e in started]
                # Kill as soon as one stream is under way: on a loaded machine a long stream may finish before
                # another has even started.
                await asyncio.wait([asyncio.create_task(e.wait()) for e in started],
                                   return_when=asyncio.FIRST_COMPLETED)
                primary.kill()
                killed = time.monotonic()
                streams = await asyncio.wait_for(asyncio.gather(*in_flight), 30)
                after = await stream_once(guard.url, {"model": "tiny", "prompt": "hi", "max_tokens": 4})
                return streams, after, time.monotonic() - killed

            streams, after, served_within = asyncio.run(scenario())
            cut = [body for status, headers, body in streams if status == 200 and "X-Guard-Route" not in headers]
            assert cut, "the stream under way when the engine died was relayed until then"
            for body in cut:
                assert b"event: error" in body and not body.endswith(b"data: [DONE]\n\n"), body[-200:]
            for status, headers, body in streams:  # the others never reached the engine: a fallback, or a 5xx
                assert status in (502, 503) or headers.get("X-Guard-Route") == "small" or body in cut, body[-200:]
            status, headers, body = after
            assert status == 200 and headers["X-Guard-Route"] == "small", body
            assert served_within < 30
            wait_for(lambda: guard.call(lambda: guard.state.modes.mode), lambda m: m == "degraded", 2)
            started = time.monotonic()
            status, headers, _ = asyncio.run(stream_once(guard.url, {"model": "tiny", "prompt": "x", "max_tokens": 2}))
            assert status == 200 and headers["X-Guard-Route"] == "small"
            assert time.monotonic() - started < 1.0, "a new request in degraded mode is served within 1 s"

            primary.start()  # on the same port
            wait_for(lambda: guard.call(lambda: guard.state.modes.mode), lambda m: m == "normal", 15)
            status, headers, _ = asyncio.run(stream_once(guard.url, {"model": "tiny", "prompt": "x",
                                                                     "max_tokens": 2}))
            assert status == 200 and "X-Guard-Route" not in headers
            assert guard.call(lambda: not guard.state.pool.reservations())
            assert mode_transitions(guard.url)[("normal", "degraded")] >= 1
            assert 'guard_mode{mode="normal"} 1.0' in request(guard.url + "/metrics")[1].decode()
    finally:
        primary.stop()


@pytest.fixture(scope="module")
def engines():
    with ServerThread(num_blocks=48) as primary, ServerThread(num_blocks=128) as fallback:
        yield primary, fallback


def test_saturation_sends_sheddable_lanes_to_the_fallback(engines) -> None:
    primary, fallback = engines
    tenants = [{"name": "chat", "api_keys": ["sk-chat"], "lane": "interactive", "weight": 2},
               {"name": "bulk", "api_keys": ["sk-bulk"], "lane": "batch", "max_queue": 500}]
    config = guard_config(primary.url, tenants=tenants, routing=ROUTING,
                          fallbacks=[{"name": "small", "url": fallback.url}])
    with GuardThread(config) as guard:
        wait_for(lambda: guard.call(lambda: guard.state.modes.mode), lambda m: m == "normal", 15)
        # 240 tokens: at 120 the primary (48 blocks, a few requests at a time) finished batch work about as fast
        # as 20 a second arrived, so its queue never built and the guard never came under pressure (1 run in 4).
        bulk_body = {"model": "tiny", "prompt": "b" * 40, "max_tokens": 240, "ignore_eos": True}

        async def scenario() -> tuple[list, list]:
            # A steady stream of batch work, more than the pool holds, until 10 more arrived once the guard was
            # under pressure (about 40 in all): on a loaded machine the mode once changed after the first 40.
            bulk, after_pressure = [], 0
            while after_pressure < 10 and len(bulk) < 160:
                bulk.append(asyncio.create_task(stream_once(guard.url, bulk_body, "sk-bulk")))
                await asyncio.sleep(0.05)
                if after_pressure or (len(bulk) >= 30 and guard.call(lambda: guard.state.modes.mode) != "normal"):
                    after_pressure += 1
            chat = []
            for _ in range(5):
                chat.append(await stream_once(guard.url, {"model": "tiny", "prompt": "hello", "max_tokens": 8},
                                              "sk-chat"))
            return await asyncio.gather(*bulk), chat

        bulk, chat = asyncio.run(scenario())
        routes = [h.get("X-Guard-Route") for _, h, _ in bulk]
        assert all(status == 200 for status, _, _ in bulk + chat)
        assert routes.count("small") > 0, "sheddable work went to the fallback under pressure"
        assert all("X-Guard-Route" not in h for _, h, _ in chat), "interactive work stayed on the primary"
        assert mode_transitions(guard.url)[("normal", "pressure")] >= 1
        assert json.loads(request(guard.url + "/health")[1])["status"] == "ok"
        wait_for(lambda: guard.call(lambda: guard.state.modes.mode), lambda m: m == "normal", 10)
        assert guard.call(lambda: not guard.state.pool.reservations())


def test_a_fresh_guard_serves_its_first_request_on_the_primary() -> None:
    """Not having heard from the engine yet is not an engine that went quiet: a request sent the moment the
    guard listens waits for the first snapshot and goes to the primary, and the mode never leaves normal."""
    with ServerThread(num_blocks=128) as engine, GuardThread(guard_config(
            engine.url, fallbacks=[{"name": "static", "message": "busy"}], routing=ROUTING)) as guard:
        status, headers, body = asyncio.run(stream_once(guard.url, {"model": "tiny", "prompt": "hi", "max_tokens": 2}))
        assert status == 200 and "X-Guard-Route" not in headers, body
        assert guard.call(lambda: guard.state.modes.mode) == "normal"
        transitions = mode_transitions(guard.url)
        assert len(transitions) == 6 and not any(transitions.values()), transitions


def test_a_guard_whose_engine_never_answers_degrades_once_its_start_is_over() -> None:
    config = guard_config("http://127.0.0.1:9", fallbacks=[{"name": "static", "message": "busy"}],
                          routing=ROUTING, admission={"telemetry_stale_s": 0.5})
    with GuardThread(config) as guard:
        started = time.monotonic()
        status, headers, _ = asyncio.run(stream_once(guard.url, {"model": "tiny", "prompt": "hi", "max_tokens": 2}))
        assert status == 200 and headers["X-Guard-Route"] == "static"
        assert time.monotonic() - started < 2.0, "no request waits longer than the start"
        wait_for(lambda: guard.call(lambda: guard.state.modes.mode), lambda m: m == "degraded", 2)
