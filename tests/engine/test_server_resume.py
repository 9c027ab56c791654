"""Resuming (``resume_token_ids``): an answer continued from the tokens an interrupted one had sent equals the
uninterrupted answer, on the real server, with the tiny model and with SmolLM2.

The interrupted answer is a real stream with ``return_token_ids``, cut after one of its events: what the
client had then is the text of the events so far, and the tokens their ``: token_ids`` comments carried.
Resumed with those tokens and the answer's id, the rest must complete it exactly: no character twice, none
missing, the same ids, one usage equal to the uninterrupted one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from support.engine_server import ServerThread
from support.invariants import assert_all_blocks_back
from support.net import request

GREEDY = {"temperature": 0.0, "ignore_eos": True}
CALC = {"type": "function", "function": {"name": "calc", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}, "op": {"type": "string", "maxLength": 12}},
    "required": ["x", "op"], "additionalProperties": False}}}


@dataclass
class Event:
    """One SSE event: the token ids its comment carried, its data (None: a comment only)."""

    token_ids: list[int] = field(default_factory=list)
    data: Any = None


def events_of(body: bytes) -> list[Event]:
    events = []
    for raw in body.decode().split("\n\n"):
        event = Event()
        for line in raw.split("\n"):
            if line.startswith(": token_ids "):
                _, _, index, ids = line.split(" ")
                assert index == "0"
                event.token_ids += [int(t) for t in ids.split(",")]
            elif line.startswith("data: ") and line != "data: [DONE]":
                event.data = json.loads(line[6:])
        if event.token_ids or event.data is not None:
            events.append(event)
    return events


def post(server: ServerThread, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    return request(server.url + path, json.dumps(body).encode())


def stream(server: ServerThread, path: str, body: dict[str, Any]) -> list[Event]:
    status, raw = post(server, path, {**body, "stream": True, "return_token_ids": True})
    assert status == 200, raw
    return events_of(raw)


def text_of(events: list[Event]) -> str:
    """The text a chat or completion stream's events carry (content deltas or completion text)."""
    out = ""
    for event in events:
        for choice in (event.data or {}).get("choices", []):
            out += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return out


def usage_of(events: list[Event]) -> dict[str, Any]:
    [usage] = [e.data["usage"] for e in events if e.data is not None and e.data.get("usage")]
    return usage


def tokens_of(events: list[Event]) -> list[int]:
    return [t for event in events for t in event.token_ids]


def resumed(server: ServerThread, path: str, body: dict[str, Any], events: list[Event], cut: int,
            **more: Any) -> list[Event]:
    """The stream resumed after ``events[:cut]``, with their tokens and the answer's id."""
    first = events[0].data
    answer_id = first["response"]["id"].removeprefix("resp_") if "response" in first else first["id"].split("-", 1)[1]
    return stream(server, path, {**body, "resume_token_ids": tokens_of(events[:cut]), "request_id": answer_id,
                                 **more})


def cuts(events: list[Event]) -> list[int]:
    """Event boundaries worth resuming at: after each event that carried tokens, but the last."""
    return [i + 1 for i, e in enumerate(events[:-1]) if e.token_ids and i + 1 < len(events)
            and any(e.token_ids for e in events[i + 1:])]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(num_blocks=256, block_size=16) as running:
        yield running


@pytest.fixture(autouse=True)
def every_block_comes_back(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in ("server", "smol"):
        if name in request.fixturenames:
            running = request.getfixturevalue(name)
            running.wait_idle()
            assert_all_blocks_back(running.core)


def assert_resumes_everywhere(server: ServerThread, path: str, body: dict[str, Any]) -> list[Event]:
    whole = stream(server, path, body)
    assert len(cuts(whole)) >= 3, whole
    for cut in cuts(whole):
        rest = resumed(server, path, body, whole, cut)
        assert text_of(whole[:cut]) + text_of(rest) == text_of(whole), cut
        assert tokens_of(whole[:cut]) + tokens_of(rest) == tokens_of(whole), cut
        assert {e.data["id"] for e in rest if e.data} == {whole[0].data["id"]}
        assert usage_of(rest) | {"prompt_tokens_details": None} == usage_of(whole) | {"prompt_tokens_details": None}
        assert usage_of(rest)["prompt_tokens_details"]["cached_tokens"] <= usage_of(rest)["prompt_tokens"]
    return whole


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Ids", "max_tokens": 20}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Ids"}], "max_tokens": 20}),
    # A tool call's first tokens open nothing yet: their ids come in comments alone.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Call"}], "tools": [CALC],
                              "tool_choice": "required", "max_tokens": 40}),
])
def test_a_token_ids_comment_comes_before_a_token_chunk_only(server: ServerThread, path: str,
                                                             body: dict[str, Any]) -> None:
    """The guard reads a comment's next line as its choice's token chunk in a stream of one choice
    (guard/wire/resume_tap.py ``token_event``): never the usage chunk, an error or the end."""
    status, raw = post(server, path, {"model": "tiny", **body, "stream": True, "return_token_ids": True,
                                      "stream_options": {"include_usage": True}, **GREEDY})
    assert status == 200, raw
    lines = raw.decode().split("\n")
    after = [lines[i + 1] for i, line in enumerate(lines) if line.startswith(": token_ids ")]
    assert len(after) >= 10 and any(line.startswith(": token_ids ") for line in after) == ("tools" in body)
    for line in after:
        if not line.startswith(": token_ids "):
            assert line.startswith("data: {") and json.loads(line[6:])["choices"], line


def test_a_completion_resumed_after_any_event_completes_the_uninterrupted_one(server: ServerThread) -> None:
    body = {"model": "tiny", "prompt": "Resume me", "max_tokens": 24, "stream_options": {"include_usage": True},
            **GREEDY}
    whole = assert_resumes_everywhere(server, "/v1/completions", body)
    assert len(tokens_of(whole)) == usage_of(whole)["completion_tokens"] == 24


def test_a_chat_resumed_does_not_repeat_its_role(server: ServerThread) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Go on"}], "max_tokens": 16,
            "stream_options": {"include_usage": True}, **GREEDY}
    whole = assert_resumes_everywhere(server, "/v1/chat/completions", body)
    rest = resumed(server, "/v1/chat/completions", body, whole, cuts(whole)[1])
    assert not any("role" in c["delta"] for e in rest if e.data for c in e.data["choices"])


def assert_stops_across_the_resume_point(server: ServerThread, body: dict[str, Any], stop: str) -> None:
    """Resumed after every event of a stream cut by ``stop``, the answer still ends before it; some of the
    cuts fall inside the stop string (its tokens partly resumed, its text held back and never sent)."""
    for _ in range(3):  # a busy machine may merge the events around the stop string: then stream again
        whole = stream(server, "/v1/completions" if "prompt" in body else "/v1/chat/completions",
                       {**body, "stop": [stop]})
        assert whole[-1].data["choices"][0]["finish_reason"] == "stop"
        tokens = tokens_of(whole)
        inside = [cut for cut in cuts(whole) if len(tokens_of(whole[:cut])) > len(tokens) - len(stop.encode())]
        if inside:
            break
    assert inside, "no event ended inside the stop string"
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    for cut in cuts(whole):
        rest = resumed(server, path, {**body, "stop": [stop]}, whole, cut)
        assert text_of(whole[:cut]) + text_of(rest) == text_of(whole), cut
        assert rest[-1].data["choices"][0]["finish_reason"] == "stop"


def test_a_stop_string_that_straddles_the_resume_point_still_stops(server: ServerThread) -> None:
    body = {"model": "tiny", "prompt": "Stop here", "max_tokens": 30, **GREEDY}
    text = text_of(stream(server, "/v1/completions", body))
    stop = text[12:16]
    assert_stops_across_the_resume_point(server, body, stop)


def test_a_seeded_sample_resumes_with_the_same_draws(server: ServerThread) -> None:
    body = {"model": "tiny", "prompt": "Draw", "max_tokens": 20, "temperature": 1.0, "seed": 7,
            "ignore_eos": True}
    whole = stream(server, "/v1/completions", body)
    tokens = tokens_of(whole)
    rest = tokens_of(stream(server, "/v1/completions", {**body, "resume_token_ids": tokens[:9]}))
    assert tokens[:9] + rest == tokens


def test_a_streamed_tool_call_resumes_with_the_same_call_ids(server: ServerThread) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Call"}], "tools": [CALC],
            "tool_choice": "required", "max_tokens": 60, "temperature": 0.0}
    whole = stream(server, "/v1/chat/completions", body)

    def calls(events: list[Event]) -> list[tuple[str | None, str]]:
        return [(call.get("id"), call["function"].get("arguments", "")) for e in events if e.data
                for c in e.data["choices"] for call in c["delta"].get("tool_calls") or []]

    def merged(parts: list[tuple[str | None, str]]) -> dict[str, str]:
        out: dict[str, str] = {}
        current = ""
        for call_id, arguments in parts:
            current = call_id or current
            out[current] = out.get(current, "") + arguments
        return out

    reference = merged(calls(whole))
    assert reference  # (the tiny model's arguments may be cut by max_tokens: compared as they come)
    for cut in cuts(whole)[::3]:
        rest = resumed(server, "/v1/chat/completions", body, whole, cut)
        assert merged(calls(whole[:cut]) + calls(rest)) == reference, cut
        assert rest[-1].data["choices"][0]["finish_reason"] == whole[-1].data["choices"][0]["finish_reason"]


def test_a_responses_stream_resumes_its_items_and_sequence_numbers(server: ServerThread) -> None:
    body = {"model": "tiny", "input": "Respond", "max_output_tokens": 12, **GREEDY}
    whole = stream(server, "/v1/responses", body)
    numbers = [e.data["sequence_number"] for e in whole if e.data]
    assert numbers == list(range(len(numbers)))
    cut = cuts(whole)[len(cuts(whole)) // 2]
    sent = [e.data for e in whole[:cut] if e.data]
    rest = resumed(server, "/v1/responses", body, whole, cut, resume_sequence_number=len(sent))
    events = sent + [e.data for e in rest if e.data]
    # One stream: numbered on without a gap, opened once (how the text falls into deltas depends on timing).
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events].count("response.created") == 1
    assert [e["type"] for e in events][-3:] == [e.data["type"] for e in whole if e.data][-3:]
    assert "".join(e.get("delta", "") for e in events if e["type"] == "response.output_text.delta") == \
        whole[-1].data["response"]["output"][0]["content"][0]["text"]
    final, reference = rest[-1].data["response"], whole[-1].data["response"]
    assert final | {"created_at": 0, "usage": None} == reference | {"created_at": 0, "usage": None}
    assert final["usage"]["output_tokens"] == reference["usage"]["output_tokens"] == 12


def test_a_unary_answer_resumed_carries_only_the_new_text(server: ServerThread) -> None:
    body = {"model": "tiny", "prompt": "Unary", "max_tokens": 20, **GREEDY}
    whole = stream(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    tokens = tokens_of(whole)
    status, raw = post(server, "/v1/completions", {**body, "resume_token_ids": tokens[:8]})
    assert status == 200, raw
    answer = json.loads(raw)
    head = bytes(tokens[:8]).decode(errors="ignore")
    assert head + answer["choices"][0]["text"] == text_of(whole)
    assert answer["usage"]["completion_tokens"] == usage_of(whole)["completion_tokens"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "n": 2, "resume_token_ids": [1]}, "resume_token_ids"),
    ("/v1/completions", {"prompt": ["x", "y"], "resume_token_ids": [1]}, "resume_token_ids"),
    ("/v1/completions", {"prompt": "x", "resume_token_ids": [1, 10**6]}, "resume_token_ids"),
    ("/v1/completions", {"prompt": "x", "resume_token_ids": [-1]}, "resume_token_ids"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "resume_token_ids": [65, 66, 67]}, "resume_token_ids"),
    ("/v1/completions", {"prompt": "x", "request_id": "has space"}, "request_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [CALC],
                              "tool_choice": "required", "resume_token_ids": [91]}, "resume_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                              "response_format": {"type": "json_object"}, "resume_token_ids": [65]},
     "resume_token_ids"),
    ("/v1/responses", {"input": "x", "resume_sequence_number": -1}, "resume_sequence_number"),
])
def test_resume_fields_are_validated_by_name(server: ServerThread, path: str, body: dict[str, Any],
                                             param: str) -> None:
    status, raw = post(server, path, {"model": "tiny", **body})
    assert status == 400, raw
    assert json.loads(raw)["error"]["param"].partition("[")[0] == param


# ------------------------------------------------------------------ SmolLM2: real text, a real grammar

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def smol() -> Iterator[ServerThread]:
    with ServerThread(model="smollm2", num_blocks=64, block_size=16) as running:
        yield running


def test_smollm2_resumes_a_chat_after_any_event(smol: ServerThread) -> None:
    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 16, "temperature": 0.0,
            "stream_options": {"include_usage": True}}
    whole = assert_resumes_everywhere(smol, "/v1/chat/completions", body)
    assert "Paris" in text_of(whole)


def test_smollm2_stop_string_straddling_the_resume_point(smol: ServerThread) -> None:
    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 16, "temperature": 0.0}
    assert "France is" in text_of(stream(smol, "/v1/chat/completions", body))
    assert_stops_across_the_resume_point(smol, body, "France is")


def test_smollm2_resumes_inside_a_json_schema(smol: ServerThread) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 40, "temperature": 0.0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
            "stream_options": {"include_usage": True}}
    whole = assert_resumes_everywhere(smol, "/v1/chat/completions", body)
    assert set(json.loads(text_of(whole))) == {"city", "country"}
