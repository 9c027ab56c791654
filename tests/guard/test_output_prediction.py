"""Requests without ``max_tokens``: the reservation holds a predicted output, not the context's room, and
grows while the stream passes it (guard/admission/predictor.py)."""

from __future__ import annotations

import json
import urllib.request

import pytest
from support.admission_parts import snapshot
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config, usable_guard
from support.net import request
from support.wait import wait_for

from guard.admission.predictor import DEFAULT_TOKENS, MIN_SAMPLES, PAD_TOKENS, OutputPredictor
from guard.config import Admission
from guard.pool.gate import AdmissionGate


def test_prediction_falls_back_from_tenant_to_lane_to_everyone_to_the_default() -> None:
    predictor = OutputPredictor()
    assert predictor.predict("acme", "interactive", room=4000) == DEFAULT_TOKENS
    assert predictor.predict("acme", "interactive", room=100) == 100, "never above what the context leaves"
    for _ in range(MIN_SAMPLES):
        predictor.record("globex", "interactive", 40)
    assert predictor.predict("acme", "interactive", 4000) == 44 + PAD_TOKENS, "the lane's: 40 x 1.1 + pad"
    for tokens in range(1, 21):  # acme's own: its 75th percentile is 15
        predictor.record("acme", "interactive", tokens)
    assert predictor.predict("acme", "interactive", 4000) == 17 + PAD_TOKENS
    assert predictor.predict("bulk", "batch", 4000) > DEFAULT_TOKENS // 100, "everyone's, not the default"


def test_a_reservation_grows_only_into_room() -> None:
    gate = AdmissionGate(Admission(safe_utilization=0.5), {"acme"})
    gate.update(snapshot(num_blocks=100, free=100))
    assert gate.try_reserve("r", "acme", 30)
    assert gate.try_grow("r", 20) and gate.reserved == 50 == gate.reservations["r"].blocks
    assert not gate.try_grow("r", 1), "past safe_utilization"
    assert not gate.try_grow("unknown", 1)
    assert gate.release("r") and gate.reserved == 0 and not gate.reserved_by_tenant


def test_a_stream_without_max_tokens_reserves_the_prediction_and_grows_past_it() -> None:
    with ServerThread(num_blocks=256, max_model_len=1024) as engine, \
            usable_guard(guard_config(engine.url)) as guard:
        guard.call(lambda: [guard.state.predictor.record("acme", "interactive", 1) for _ in range(MIN_SAMPLES)])
        seen: list[int] = []  # the request's reserved blocks, sampled while it streams
        # The built-in model's bytes rarely make whole characters, so few of its tokens become events: the
        # guard counts events (a lower bound of tokens), and a long output gives enough of them.
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 30}], "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        req = urllib.request.Request(guard.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer sk-acme"})
        events, usage, done = 0, {}, False
        with urllib.request.urlopen(req, timeout=60) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    events += 1
                    seen += [r.blocks for r in guard.call(lambda: list(guard.state.pool.reservations().values()))]
                    usage = json.loads(line[6:]).get("usage") or usage
                done = line.strip() == b"data: [DONE]" or done
        assert done and usage["total_tokens"] == 1024, f"ran to the end of the context: {usage}"
        room_blocks = -(-1024 // 16)
        assert seen and min(seen) < room_blocks / 4, f"first reserved the prediction, not the room: {seen}"
        assert max(seen) > min(seen), "the reservation grew while the output passed it"
        metrics = request(guard.url + "/metrics")[1].decode()
        assert 'guard_reservation_growths_total{result="granted"}' in metrics
        assert guard.call(lambda: not guard.state.pool.reservations())
        # The request's own output now feeds the prediction (a tenant's own history wins once it is long).
        assert json.loads(request(guard.url + "/health")[1])["mode"] == "normal"


@pytest.mark.parametrize("num_blocks", [32, 64])
def test_a_chat_without_max_tokens_is_served_by_a_pool_smaller_than_its_window(num_blocks: int) -> None:
    """The engine bounds such a chat by its pool, not its window: the guard sends no bound of its own (once
    it sent the window's room, which the engine refused), and shrinks its prediction to fit the budget (32
    blocks: the 512-token default needs more than the 27 it may commit)."""
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0})
    with ServerThread(num_blocks=num_blocks, max_model_len=2048) as engine, \
            GuardThread(guard_config(engine.url)) as guard:
        wait_for(lambda: guard.call(guard.state.pool.any_usable), bool, 5)
        assert request(engine.url + "/v1/chat/completions", body.encode())[0] == 200
        status, answer = request(guard.url + "/v1/chat/completions", body.encode(), {"Authorization": "Bearer sk-acme"})
        assert status == 200, answer
