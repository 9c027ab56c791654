"""Streamed usage through the guard (guard/wire/relay.py ``StreamObserver``, guard/http/validate.py
``upstream_body``): the guard asks the engine for usage on every stream and charges what it says, and a
client that did not ask for usage gets the stream less the usage event, as if there were no guard.

First the observer alone, on the engine's own SSE framing cut into chunks at every byte position (and at
any set of them): what it relays is the input less the usage event, every complete line as soon as its
chunk arrives. Then the real guard in front of the real tiny engine: a forced tool call streamed, its
arguments in deltas that may each carry several tokens, charged what the engine's usage says.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from itertools import pairwise

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config, usable_guard
from support.net import request
from support.wait import wait_for

from engine.protocol import (
    SSE_DONE,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ErrorResponse,
    PromptTokensDetails,
    Usage,
    sse_comment,
    sse_data,
    sse_error,
)
from guard.admission.fairness import INPUT_COST, OUTPUT_COST
from guard.wire.relay import StreamObserver, _tokens_only
from guard.wire.resume_tap import ResumeTap

# -- the observer on byte chunks ----------------------------------------------------------------------------


def chunk(content: str | None, usage: Usage | None = None, finish: bool = False) -> bytes:
    choices = [] if content is None else [ChatChunkChoice(index=0, delta=ChatDelta(content=content),
                                                          finish_reason="stop" if finish else None)]
    return sse_data(ChatCompletionChunk(id="chatcmpl-1", created=0, model="tiny", choices=choices,
                                        usage=usage).model_dump_json())


USAGE = Usage(prompt_tokens=5, completion_tokens=9, total_tokens=14, prompt_tokens_details=PromptTokensDetails())
USAGE_EVENT = chunk(None, USAGE)
TOKENS = [chunk("Hello"), sse_comment("heartbeat"), chunk(' "usage":{"x": 1} is text'), chunk("é", finish=True)]
STREAM = b"".join(TOKENS) + USAGE_EVENT + SSE_DONE
# A stream that ends with an error event instead of [DONE]: the error event passes like any other.
FAILED = b"".join(TOKENS) + USAGE_EVENT + sse_error(ErrorResponse.of(502, "gone", code="upstream_stream_error"))


def pieces(stream: bytes, cuts: list[int]) -> list[bytes]:
    """``stream`` cut at ``cuts``, as the upstream's reads might give it (no empty chunk)."""
    return [stream[start:end] for start, end in pairwise([0, *sorted(cuts), len(stream)]) if end > start]


def relay(stream: bytes, cuts: list[int], strip_usage: bool) -> tuple[list[bytes], StreamObserver]:
    """``stream`` fed in the chunks ``cuts`` makes; what went out after each, then ``flush``."""
    observer = StreamObserver(on_first_token=lambda now: None, on_gap=lambda gap: None, strip_usage=strip_usage)
    return [*map(observer.feed, pieces(stream, cuts)), observer.flush()], observer


def without_usage(stream: bytes) -> bytes:
    """What a client that did not ask for usage gets of ``stream``'s complete lines."""
    complete = stream[:stream.rfind(b"\n") + 1].replace(USAGE_EVENT, b"")
    usage_line = USAGE_EVENT[:-1]  # the data line has come, the blank line that ends its event not yet
    return complete.removesuffix(usage_line)


def check_stripped(stream: bytes, cuts: list[int]) -> StreamObserver:
    out, observer = relay(stream, cuts, strip_usage=True)
    assert b"".join(out) == stream.replace(USAGE_EVENT, b""), cuts
    # Every complete line went out with the chunk that completed it: only a line's start was held back.
    bounds = sorted({*cuts, len(stream)} - {0})
    for end, sent in zip(bounds, (b"".join(out[:i + 1]) for i in range(len(bounds))), strict=True):
        assert sent == without_usage(stream[:end]), (cuts, end)
    assert observer.completion_tokens == USAGE.completion_tokens and observer.output_tokens == 9
    return observer


@pytest.mark.parametrize("stream", [STREAM, FAILED], ids=["done", "error"])
def test_every_single_cut_relays_the_stream_less_its_usage_event(stream: bytes) -> None:
    for cut in range(len(stream) + 1):
        check_stripped(stream, [cut])
    observer = check_stripped(stream, list(range(1, len(stream))))  # a byte at a time
    assert observer.finished == (stream is STREAM)
    assert observer.events == 3, "the heartbeat, the usage event, [DONE] and an error event are no token events"


@settings(max_examples=300, deadline=None)
@given(st.sets(st.integers(1, len(STREAM) - 1), max_size=12))
def test_any_cuts_relay_the_stream_less_its_usage_event(cuts: set[int]) -> None:
    check_stripped(STREAM, list(cuts))


@given(st.sets(st.integers(1, len(STREAM) - 1), max_size=12))
def test_a_client_that_asked_for_usage_gets_every_chunk_as_it_came(cuts: set[int]) -> None:
    out, observer = relay(STREAM, list(cuts), strip_usage=False)
    assert out == [*pieces(STREAM, list(cuts)), b""]
    assert observer.output_tokens == 9 and observer.finished


# The stream as a kvguard engine writes it for a resumable request: each token event after the token ids it
# adds (the usage event and the end carry none, engine/server/openai_api.py), and before the last one the ids
# of an event withheld (a comment alone, as a tool call's tokens that open nothing yet).
TAPPED = b"".join([*(b": token_ids 0 %d\n" % i + event if event.startswith(b"data: {") else event
                     for i, event in enumerate(TOKENS[:-1])), b": token_ids 0 7\n",
                   b": token_ids 0 3\n" + TOKENS[-1], USAGE_EVENT, SSE_DONE])
# Cut after each event: the chunks of a paced engine, each token event whole (the observer's token path).
EVENT_ENDS = {end + 2 for end in range(len(TAPPED) - 3) if TAPPED[end:end + 2] == b"\n\n"}


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(1, len(TAPPED) - 1), max_size=12))
@example(EVENT_ENDS)
def test_with_a_tap_whole_events_go_out_in_one_pass_as_through_the_tap_then_the_observer(cuts: set[int]) -> None:
    """``feed`` with a tap counts the usual events itself, sending only the rest through the tap's ``notice``
    and the line-by-line reading: the same as the tap's ``take`` and then the observer without it."""
    fused = StreamObserver(on_first_token=lambda now: None, on_gap=lambda gap: None, strip_usage=True,
                           tap=ResumeTap())
    apart = StreamObserver(on_first_token=lambda now: None, on_gap=lambda gap: None, strip_usage=True)
    tap = ResumeTap()
    for piece in pieces(TAPPED, list(cuts)):
        assert fused.feed(piece) == apart.feed_events(tap.take(piece)), cuts
    assert fused.flush() == apart.feed_events(tap.flush()) + apart.flush()
    assert (fused.events, fused.output_tokens, fused.finished) == (apart.events, 9, True) == (3, 9, True)
    assert fused.tap.token_ids() == tap.token_ids() == [0, 2, 7, 3]
    assert fused.tap.answer_key == tap.answer_key == "1"


@pytest.mark.parametrize(("data", "tokens_only"), [
    (chunk("Hello"), True),  # "usage":null, as the engine writes every token chunk: no usage
    (chunk("a") + chunk("b"), True),
    (chunk(' "usage":{"x": 1} is text'), True),  # the key inside a text is escaped: text
    (USAGE_EVENT, False),
    (chunk("a") + USAGE_EVENT, False),
    (chunk("a").replace(b'"usage":null', b'"usage": null'), False),  # spelled otherwise: read line by line
    (SSE_DONE, False),
])
def test_token_chunks_with_a_null_usage_take_the_token_path(data: bytes, tokens_only: bool) -> None:
    """A kvguard engine's token chunks carry ``"usage":null``: they are counted as tokens without reading them
    line by line, and anything that may be usage still is."""
    assert _tokens_only(data) is tokens_only


def test_a_last_line_without_its_newline_still_reaches_the_client() -> None:
    unterminated = b"".join(TOKENS) + USAGE_EVENT + SSE_DONE.rstrip(b"\n")
    for cut in range(len(unterminated) + 1):
        out, _ = relay(unterminated, [cut], strip_usage=True)
        assert b"".join(out) == unterminated.replace(USAGE_EVENT, b""), cut


def test_without_usage_the_events_are_counted() -> None:
    """A backend that ignores ``stream_options`` (a fallback): one token per event is all there is."""
    stream = b"".join(TOKENS) + SSE_DONE
    _, observer = relay(stream, [7, len(stream) // 2], strip_usage=True)
    assert observer.completion_tokens is None and observer.output_tokens == observer.events == 3


# -- the real guard in front of the real engine -------------------------------------------------------------

# Bounded in every part, so that the random weights of the built-in model finish the call in a few tokens.
PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"kind": {"enum": ["x", "yy", "zzz"]}, "flag": {"type": "boolean"}},
    "required": ["kind", "flag"], "additionalProperties": False}}}
TOOL_CALL = {"model": "tiny", "messages": [{"role": "user", "content": "pick one"}], "tools": [PICK],
             "tool_choice": {"type": "function", "function": {"name": "pick"}}, "temperature": 0,
             "max_tokens": 64, "stream": True}
# What differs between two answers to the same request: their ids and creation times.
UNIQUE = re.compile(rb'"id":"[^"]*"|"created":\d+')


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerThread]:
    with ServerThread(num_blocks=256) as server:
        yield server


@pytest.fixture(scope="module")
def guard(engine: ServerThread) -> Iterator[GuardThread]:
    with usable_guard(guard_config(engine.url)) as g:
        yield g


def events(raw: bytes) -> list[bytes]:
    """A complete stream's events (each without the blank line that ends it)."""
    assert raw.endswith(b"\n\n"), raw[-200:]
    return raw.split(b"\n\n")[:-1]


def service(guard: GuardThread) -> float:
    """The service the fair queue has charged tenant acme so far (``guard_service_tokens_total``)."""
    return guard.call(lambda: guard.state.dispatcher.fair.tenants["acme"].service)


def streamed_call(answer: list[bytes]) -> tuple[str, str | None]:
    """A streamed tool call's arguments (its deltas concatenated) and the stream's finish reason."""
    chunks = [json.loads(event.removeprefix(b"data: ")) for event in answer]
    deltas = [call for c in chunks for call in c["choices"][0]["delta"].get("tool_calls", [])]
    return "".join(call["function"]["arguments"] for call in deltas), chunks[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("include_usage", [False, True], ids=["usage_not_asked", "usage_asked"])
def test_a_streamed_tool_call_is_charged_its_tokens_and_relayed_as_asked(
        guard: GuardThread, engine: ServerThread, include_usage: bool) -> None:
    status, direct = request(engine.url + "/v1/chat/completions",
                             json.dumps({**TOOL_CALL, "stream_options": {"include_usage": True}}).encode())
    assert status == 200, direct
    *answer, usage_event, done = events(direct)
    usage = json.loads(usage_event.removeprefix(b"data: "))["usage"]
    arguments, finish = streamed_call(answer)
    assert done == b"data: [DONE]" and finish == "tool_calls" and json.loads(arguments), answer

    before = service(guard)
    body = {**TOOL_CALL, "stream_options": {"include_usage": True}} if include_usage else TOOL_CALL
    status, raw = request(guard.url + "/v1/chat/completions", json.dumps(body).encode(),
                          headers={"Authorization": "Bearer sk-acme"})
    assert status == 200, raw
    # As the engine answers the client's own request (greedy: the same call, however its deltas were cut):
    # its usage event unchanged if it asked, else none.
    *relayed, last = events(raw)
    if include_usage:
        *relayed, relayed_usage = relayed
        assert UNIQUE.sub(b"", relayed_usage) == UNIQUE.sub(b"", usage_event)
    assert last == b"data: [DONE]" and streamed_call(relayed) == (arguments, finish)
    assert all(json.loads(event[6:])["choices"] for event in relayed), "no usage chunk the client did not ask for"
    # Settlement, the fairness charge and the predictor all take the same count; the charge shows it.
    charged = INPUT_COST * usage["prompt_tokens"] + OUTPUT_COST * usage["completion_tokens"]
    wait_for(lambda: service(guard) - before, lambda got: got == charged, 5)


def test_a_completion_stream_without_usage_gets_none(guard: GuardThread) -> None:
    """The guard's ``stream_options`` is valid on /v1/completions too, and stripped from its answer."""
    body = {"model": "tiny", "prompt": "usage", "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {}}
    status, raw = request(guard.url + "/v1/completions", json.dumps(body).encode(),
                          headers={"Authorization": "Bearer sk-acme"})
    assert status == 200, raw
    *answer, done = events(raw)
    assert done == b"data: [DONE]" and answer and all(json.loads(e[6:])["choices"] for e in answer), answer
