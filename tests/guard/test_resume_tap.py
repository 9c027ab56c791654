"""The resume tap (guard/wire/resume_tap.py) on bytes as a kvguard engine writes them, split anywhere: only whole
events go through, without their token id comments; the ids it holds are exactly those of what went through,
by choice; an engine error asking for a resume is withheld and named. And a choice's own stream renumbered
into a stream of several (guard/wire/choices.py)."""

from __future__ import annotations

import json

import pytest

from guard.wire.choices import ChoiceFailed, renumbered
from guard.wire.resume_tap import ResumeTap

EVENTS = [b": token_ids 0 12,13\ndata: " + json.dumps({"id": "chatcmpl-abc123", "choices": [{"delta": {"content": "Hi"}}]}).encode() + b"\n\n",
          b": token_ids 0 14\n",  # a comment alone: its event was withheld (a tool call that opened nothing yet)
          b": token_ids 0 15\ndata: {\"id\": \"chatcmpl-abc123\", \"choices\": []}\n\n",
          b"data: [DONE]\n\n"]
STREAM = b"".join(EVENTS)


def test_whole_events_pass_without_comments_whatever_the_chunks() -> None:
    for size in (1, 2, 7, 33, len(STREAM)):
        tap, out, ids_at_each_event = ResumeTap(count_events=True), b"", []
        for start in range(0, len(STREAM), size):
            passed = tap.take(STREAM[start:start + size])
            out += passed
            if passed:
                ids_at_each_event.append((out.count(b"\n\n"), tap.token_ids()))
        assert out == STREAM.replace(b": token_ids 0 12,13\n", b"").replace(b": token_ids 0 14\n", b"") \
            .replace(b": token_ids 0 15\n", b""), size
        assert tap.token_ids() == [12, 13, 14, 15] and tap.answer_key == "abc123" and tap.events == 3
        # Whenever something went through, the ids held are those of the whole events sent so far.
        for events_sent, ids in ids_at_each_event:
            assert ids == {1: [12, 13], 2: [12, 13, 14, 15], 3: [12, 13, 14, 15]}[events_sent], size


def test_a_broken_stream_keeps_only_what_went_through() -> None:
    tap = ResumeTap()
    assert tap.take(EVENTS[0] + EVENTS[1] + EVENTS[2][:20]) == EVENTS[0][len(b": token_ids 0 12,13\n"):]
    tap.reset_held()
    assert tap.token_ids() == [12, 13]


def test_an_engine_error_asking_for_a_resume_is_withheld_and_named() -> None:
    error = b'event: error\ndata: {"error": {"message": "m", "type": "t", "param": null, "code": "resume_elsewhere"}}\n\n'
    tap = ResumeTap()
    assert tap.take(EVENTS[0] + error) == EVENTS[0][len(b": token_ids 0 12,13\n"):]
    assert tap.interrupted == "drain"
    other = ResumeTap()
    refusal = error.replace(b"resume_elsewhere", b"invalid_request")
    assert other.take(refusal) == refusal and other.interrupted is None


def test_a_last_event_without_its_blank_line_is_flushed_at_the_end() -> None:
    tap = ResumeTap()
    assert tap.take(b"data: [DONE]\n") == b""
    assert tap.flush() == b"data: [DONE]\n"


def event(index: int, text: str, finish: str | None = None) -> bytes:
    reason = "null" if finish is None else f'"{finish}"'
    return (b'data: {"id":"chatcmpl-abc","choices":[{"index":%d,"delta":{"content":"%s"},"finish_reason":%s}]}\n\n'
            % (index, text.encode(), reason.encode()))


def test_token_id_comments_are_kept_by_choice_and_never_reach_the_client() -> None:
    tap = ResumeTap(choices=2)
    sent = tap.take(b": token_ids 0 1,2\n" + event(0, "a") + b": token_ids 1 7\n" + event(1, "b", "length")
                    + b": token_ids 0 3\n" + event(0, "c"))
    assert sent == event(0, "a") + event(1, "b", "length") + event(0, "c")
    assert (tap.token_ids(0), tap.token_ids(1), tap.ended, tap.answer_key) == ([1, 2, 3], [7], {1}, "abc")


def test_the_same_bytes_inside_a_text_are_text() -> None:
    """A model may write ": token_ids 0 9" (asked to): inside a data line it is the answer, not a comment."""
    tap = ResumeTap()
    text = event(0, ": token_ids 0 9\\n")
    assert tap.take(b": token_ids 0 4\n" + text) == text and tap.token_ids() == [4]


def test_only_one_whole_token_event_after_its_comment_takes_the_short_way() -> None:
    """``token_event`` takes a kvguard engine's usual chunk and leaves every other to ``whole_events``."""
    tap, token = ResumeTap(), event(0, "a")
    assert tap.token_event(b": token_ids 0 5\n" + token, 1.0) == token and tap.token_ids() == [5]
    assert tap.last_byte == 1.0
    error = b'event: error\ndata: {"error": {"code": "x"}}\n\n'
    for other in (token,  # no comment
                  b": heartbeat\n" + token,  # a comment, not of token ids
                  b": token_ids 0 6\n",  # a comment alone (its event withheld)
                  b": token_ids 0 6\n" + token[:-1],  # the event not whole yet
                  b": token_ids 0 6\n" + token + token,  # two events
                  b": token_ids 0 6\n" + error,  # an event of two lines
                  b": token_ids 0 6\n: token_ids 0 7\n" + token,  # two comments
                  b": token_ids 0 6\n\n\n"):  # a comment and blank lines
        assert tap.token_event(other, 2.0) is None, other
    assert tap.token_ids() == [5] and tap.last_byte == 1.0
    assert tap.take(b": token_ids 0 6\ndata: {") == b""  # part of an event held: the next chunk completes it
    assert tap.token_event(b'"x": 1}\n\n', 3.0) is None


def test_the_short_way_is_for_a_stream_of_one_choice_whose_engine_sends_ids() -> None:
    taps = {"ids": ResumeTap(), "no ids": ResumeTap(), "two choices": ResumeTap(choices=2),
            "counted": ResumeTap(count_events=True)}
    for name, tap in taps.items():
        tap.take((b"" if name == "no ids" else b": token_ids 0 5\n") + event(0, "a"))
    assert {name: tap.ids for name, tap in taps.items()} == {"ids": True, "no ids": False, "two choices": False,
                                                             "counted": False}


def test_a_choice_s_own_stream_is_renumbered_and_keeps_its_usage_and_done_back() -> None:
    usages: list[dict] = []
    usage = b'data: {"id":"chatcmpl-abc","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n'
    assert renumbered(event(0, "x") + usage + b"data: [DONE]\n\n", 2, usages) == event(2, "x")
    assert usages == [{"id": "chatcmpl-abc", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}]
    with pytest.raises(ChoiceFailed, match="boom"):
        renumbered(b'event: error\ndata: {"error":{"message":"boom"}}\n\n', 1, usages)


def test_a_stream_of_one_choice_whose_first_event_has_no_ids_is_framed_and_not_searched() -> None:
    """An engine that writes no token id comments (not a kvguard engine) writes none later either: after its
    first event the tap only frames events (whole ones go through, as they came); a stream of several choices
    or a counted one is searched for comments throughout."""
    plain = ResumeTap()
    assert plain.take(event(0, "a")) == event(0, "a") and not plain.comments
    later = event(0, "b")
    assert plain.take(later[:9]) == b"" and plain.take(later[9:]) == later, "still whole events only"
    for tap in (ResumeTap(choices=2), ResumeTap(count_events=True)):
        tap.take(event(0, "a"))
        assert tap.comments and tap.take(b": token_ids 0 8\n" + event(0, "c")) == event(0, "c")
        assert tap.token_ids() == [8]
