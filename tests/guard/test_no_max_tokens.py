"""Chats without ``max_tokens`` (the SDKs' default; issue 14): SmolLM2 behind a guard that has a fallback.

Such a request once reserved all the room its context leaves (8192 tokens of SmolLM2's window: 512 blocks
of 16). The primary here has ``NUM_BLOCKS``, a few hundred, sized so that this old reservation shows the
issue's failure: one default chat fits the guard's budget (0.85 x 768 = 652 blocks), two are 1024 blocks
committed or queued, a saturation of 1.33, past ``pressure_enter`` (0.9), and the tenant then holds more
than its share, so its next chat went to the fallback's random ``tiny`` model; ``n=2`` (1023 blocks) was a
400. ``test_the_pool_would_have_shown_the_old_failure`` checks that arithmetic against the engine's own
counts. Now a request reserves a predicted output (guard/admission/predictor.py: 512 tokens before any
output was seen, so some 35 blocks), and six concurrent default chats stay on the primary in normal mode.

The questions make SmolLM2 answer in a sentence (greedy, about ten tokens), so the module takes seconds of
generation; the model's load is most of its time. The primary runs the exact ``fp32`` weights, not the
engine's default ``auto`` (4-bit): these chats end only where the model stops by itself, and on "What is the
capital of France?" the file's exact weights prefer "The" to "L" by 0.08 logits, a near-tie that the 4-bit
path (as llama.cpp on the same file) breaks the other way, into a list of French words that never reaches
EOS and runs to the 8192-token context (minutes). The claim here is the guard's, not the weight format's.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config, mode_transitions
from support.net import request
from support.nothing_lost import guard_holds_nothing, idle_and_free
from support.wait import wait_for

from guard.config import Admission, Routing
from guard.pool.gate import blocks_for

MODEL = "smollm2"
NUM_BLOCKS = 768
BLOCK_SIZE = 16
QUESTIONS = ["What is the capital of France?", "What is the capital of Germany?", "What is the capital of Japan?",
             "What is the capital of Italy? Answer in one sentence.", "How many days are in a week?",
             "What is 2 plus 2?"]


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[ServerThread, GuardThread]]:
    with ServerThread(model=MODEL, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                      weight_format="fp32") as primary, \
            ServerThread(num_blocks=128) as fallback, \
            GuardThread(guard_config(primary.url, fallbacks=[{"name": "small", "url": fallback.url}])) as guard:
        wait_for(lambda: guard.call(guard.state.pool.any_usable), bool, 15)
        yield primary, guard


@pytest.fixture(scope="module")
def client(stack: tuple[ServerThread, GuardThread]) -> openai.OpenAI:
    # A chat that has not ended in two minutes has run away (a sentence takes seconds): fail, not stall.
    return openai.OpenAI(base_url=stack[1].url + "/v1", api_key="sk-acme", max_retries=0, timeout=120)


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def whole_room_blocks(primary: ServerThread, question: str, n: int = 1) -> int:
    """What a default chat reserved before predictions: its prompt plus all the room the context window
    leaves, from the engine's own count of the prompt."""
    body = json.dumps({"model": MODEL, "messages": messages(question)}).encode()
    status, answer = request(primary.url + "/tokenize", body)
    assert status == 200, answer
    counted = json.loads(answer)
    return blocks_for(BLOCK_SIZE, counted["count"], counted["max_model_len"] - counted["count"], n)


def chat(client: openai.OpenAI, question: str, stream: bool) -> tuple[dict[str, str], str, Any]:
    """One default chat (no ``max_tokens``, greedy): the answer's headers, its text and its usage."""
    if not stream:
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages(question),
                                                               temperature=0)
        completion = raw.parse()
        return dict(raw.headers), completion.choices[0].message.content or "", completion.usage
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=messages(question), temperature=0, stream=True,
            stream_options={"include_usage": True}) as response:
        text, usage = "", None
        for chunk in response.parse():
            text += "".join(choice.delta.content or "" for choice in chunk.choices)
            usage = chunk.usage or usage
        return dict(response.headers), text, usage


def assert_everything_back(primary: ServerThread, guard: GuardThread) -> None:
    """No reservation left in the guard, nothing queued, every engine block free or cached."""
    wait_for(lambda: guard_holds_nothing(guard), lambda held: held == ({}, 0), 10)
    wait_for(primary.telemetry, idle_and_free, 10)


def test_the_pool_would_have_shown_the_old_failure(stack: tuple[ServerThread, GuardThread]) -> None:
    """The sizing argument of the module docstring, from the engine's own counts and the guard's defaults."""
    primary, _ = stack
    budget = int(Admission().safe_utilization * NUM_BLOCKS)
    for question in QUESTIONS:
        whole_room = whole_room_blocks(primary, question)
        assert whole_room <= budget < 2 * whole_room, (question, whole_room, budget)
        assert 2 * whole_room / NUM_BLOCKS >= Routing().pressure_enter, (question, whole_room)
        assert whole_room_blocks(primary, question, n=2) > budget, "n=2 was refused"


def test_six_default_chats_stay_on_the_primary_in_normal_mode(stack: tuple[ServerThread, GuardThread],
                                                               client: openai.OpenAI) -> None:
    primary, guard = stack
    modes: set[str] = set()
    reserved: list[int] = []  # each admitted request's blocks, sampled while the chats run
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            mode, blocks = guard.call(lambda: (guard.state.modes.mode,
                                               [r.blocks for r in guard.state.pool.reservations().values()]))
            modes.add(mode)
            reserved.extend(blocks)
            done.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:  # half of them streamed: both paths of the relay
            answers = list(pool.map(lambda iq: chat(client, iq[1], stream=iq[0] % 2 == 0), enumerate(QUESTIONS)))
    finally:
        done.set()
        watcher.join()
    for question, (headers, text, usage) in zip(QUESTIONS, answers, strict=True):
        assert "x-guard-route" not in headers and headers["x-guard-backend"] == "primary", (question, headers)
        assert text and usage.completion_tokens < 64, (question, text)
    assert "Paris" in answers[0][1]
    assert modes == {"normal"}, modes
    assert not any(mode_transitions(guard.url).values()), mode_transitions(guard.url)
    room = min(whole_room_blocks(primary, question) for question in QUESTIONS)
    assert reserved and max(reserved) < room / 4, f"a predicted output, not the room: {max(reserved)} blocks"
    assert_everything_back(primary, guard)


def test_n_2_without_max_tokens_is_served_with_two_choices(stack: tuple[ServerThread, GuardThread],
                                                           client: openai.OpenAI) -> None:
    primary, guard = stack
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages(QUESTIONS[0]), n=2,
                                                           temperature=0)
    completion = raw.parse()
    assert raw.status_code == 200 and raw.headers["x-guard-backend"] == "primary"
    assert "x-guard-route" not in raw.headers
    assert [choice.index for choice in completion.choices] == [0, 1]
    assert all("Paris" in (choice.message.content or "") for choice in completion.choices), completion
    assert guard.call(lambda: guard.state.modes.mode) == "normal"
    assert_everything_back(primary, guard)
