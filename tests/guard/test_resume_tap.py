"""The resume tap (guard/wire/resume_tap.py) on bytes as a kvguard engine writes them, split anywhere: only whole
events go through, without their token id comments; the ids it holds are exactly those of what went through;
an engine error asking for a resume is withheld and named."""

from __future__ import annotations

import json

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
