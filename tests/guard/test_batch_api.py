"""The Batch API end to end: the unmodified ``openai`` SDK -> a real guard (embedded store) -> the real tiny
engine on loopback. Lines run through the guard's own pipeline; the answers are compared with the same
requests sent to the engine directly."""

from __future__ import annotations

import io
import json
import sqlite3
from pathlib import Path

import openai
import pytest
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config, usable_guard
from support.net import request
from support.wait import wait_for

from guard.batch.pace import PEAK_WINDOW_S, OtherPeak, Pacer
from guard.console.app import CONSOLE

LINES = 40
CANCELLED = 400  # lines of the batch cancelled early: far more than run at once


@pytest.fixture(scope="module")
def engine():
    with ServerThread(num_blocks=256) as server:
        yield server


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("batch-store")


@pytest.fixture(scope="module")
def guard(engine, store):
    config = guard_config(engine.url, batch={"store": str(store), "max_lines": 500},
                          admin={"host": "127.0.0.1", "port": 0})
    with usable_guard(config) as g:
        yield g


def client(guard: GuardThread, key: str = "sk-acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=guard.url + "/v1", api_key=key, max_retries=0)


def chat_body(i: int, max_tokens: int = 6) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": max_tokens,
            "temperature": 0}


def jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def chat_lines(count: int, max_tokens: int = 6) -> list[dict]:
    return [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": chat_body(i, max_tokens)}
            for i in range(count)]


def upload(sdk: openai.OpenAI, content: bytes):
    return sdk.files.create(file=("input.jsonl", io.BytesIO(content)), purpose="batch")


def finished(sdk: openai.OpenAI, batch_id: str, timeout: float = 60.0):
    return wait_for(lambda: sdk.batches.retrieve(batch_id),
                    lambda b: b.status in ("completed", "failed", "expired", "cancelled"), timeout, interval=0.2)


def output_of(sdk: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in sdk.files.content(file_id).read().splitlines()]


def direct(engine: ServerThread, body: dict) -> dict:
    status, raw = request(engine.url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, raw
    return json.loads(raw)


def test_forty_lines_through_the_sdk_match_direct_requests(guard: GuardThread, engine: ServerThread) -> None:
    sdk = client(guard)
    file = upload(sdk, jsonl(chat_lines(LINES)))
    assert file.purpose == "batch" and file.bytes > 0 and file.id.startswith("file-")
    batch = sdk.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"run": "e2e"})
    assert batch.status == "validating" and batch.request_counts.total == LINES
    batch = finished(sdk, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (LINES, 0)
    assert batch.error_file_id is None and batch.metadata == {"run": "e2e"}
    out = output_of(sdk, batch.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(LINES)), "each custom_id once"
    for o in out:
        i = int(o["custom_id"].split("-")[1])
        assert o["error"] is None and o["response"]["status_code"] == 200
        assert o["response"]["request_id"] == f"{batch.id}:{i + 1}", "the decision record names batch and line"
        got, want = o["response"]["body"], direct(engine, chat_body(i))
        assert (got["choices"], got["usage"], got["model"]) == (want["choices"], want["usage"], want["model"])
    record = guard.call(lambda: guard.state.records.get(f"{batch.id}:1")).to_dict()
    assert record["tenant"] == "acme" and record["status"] == 200 and record["reservation"]["blocks"]
    assert record["reservation"]["borrowed"] == record["reservation"]["blocks"], "sheddable: every block is lent"
    assert metric(guard, "guard_batch_requests_total", tenant="acme", status="completed") >= LINES
    wait_for(lambda: metric(guard, "guard_batches", status="completed"), lambda n: n >= 1, 5)
    assert metric(guard, "guard_batch_lines_pending") == 0


def metric(guard: GuardThread, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples on the guard's /metrics with ``labels``."""
    text = request(guard.url + "/metrics")[1].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()))


def test_another_tenants_file_and_batch_are_404(guard: GuardThread) -> None:
    acme, globex = client(guard), client(guard, "sk-globex")
    file = upload(acme, jsonl(chat_lines(2)))
    batch = acme.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: globex.files.retrieve(file.id), lambda: globex.files.content(file.id),
                 lambda: globex.files.delete(file.id), lambda: globex.batches.retrieve(batch.id),
                 lambda: globex.batches.cancel(batch.id),
                 lambda: globex.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert file.id not in [f.id for f in globex.files.list()]
    assert batch.id not in [b.id for b in globex.batches.list()]
    assert finished(acme, batch.id).status == "completed"


def test_list_pages_newest_first(guard: GuardThread) -> None:
    sdk = client(guard, "sk-globex")
    file = upload(sdk, jsonl(chat_lines(1)))
    made = [sdk.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h").id
            for _ in range(3)]
    first = sdk.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    rest = sdk.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in rest.data][:1] == [made[0]]
    assert [b.id for b in sdk.batches.list()][:3] == made[::-1], "the SDK's auto-paging sees them all"
    for batch_id in made:
        finished(sdk, batch_id)


def test_cancel_stops_new_lines_and_ends_cancelled(guard: GuardThread) -> None:
    sdk = client(guard)
    file = upload(sdk, jsonl(chat_lines(CANCELLED, max_tokens=32)))
    batch = sdk.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: sdk.batches.retrieve(batch.id).request_counts.completed, lambda n: n >= 2, 30, interval=0.05)
    shown = json.loads(request(guard.app[CONSOLE].url + "/state")[1])["batches"]
    assert [(b["id"], b["tenant"], b["total"]) for b in shown] == [(batch.id, "acme", CANCELLED)], "the console"
    assert 0 < shown[0]["pending"] < CANCELLED
    cancelling = sdk.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = finished(sdk, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None and done.cancelling_at is not None
    ran = done.request_counts.completed
    assert 2 <= ran < CANCELLED
    out, errors = output_of(sdk, done.output_file_id), output_of(sdk, done.error_file_id)
    assert len(out) == ran and len(errors) == CANCELLED - ran
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert sorted(o["custom_id"] for o in out + errors) == sorted(f"req-{i}" for i in range(CANCELLED))
    with pytest.raises(openai.ConflictError):
        sdk.batches.cancel(batch.id)


def test_upload_is_validated_with_the_line_number(guard: GuardThread) -> None:
    sdk = client(guard)
    good = chat_lines(3)
    cases = {
        2: [good[0], {**good[1], "method": "GET"}],
        3: [good[0], good[1], {**good[2], "custom_id": "req-0"}],
        4: [*good, {**good[0], "custom_id": "x", "url": "/v1/completions",
                    "body": {"model": "tiny", "prompt": "p"}}],
        5: [*good, {**good[0], "custom_id": "y"}, {**good[0], "custom_id": "z",
                                                   "body": {**good[0]["body"], "model": "other"}}],
    }
    for number, lines in cases.items():
        with pytest.raises(openai.BadRequestError, match=f"line {number}:"):
            upload(sdk, jsonl(lines))
    with pytest.raises(openai.BadRequestError, match="line 2: not valid JSON"):
        upload(sdk, jsonl(good[:1]) + b"{not json\n")
    with pytest.raises(openai.BadRequestError, match="more than 500 lines"):
        upload(sdk, jsonl(chat_lines(501)))
    with pytest.raises(openai.BadRequestError, match="cannot stream"):
        upload(sdk, jsonl([{**good[0], "body": {**good[0]["body"], "stream": True}}]))
    file = upload(sdk, jsonl(good))
    with pytest.raises(openai.BadRequestError, match="one endpoint per batch"):
        sdk.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    assert sdk.files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(file.id)


def test_a_line_the_engine_refuses_goes_to_the_error_file(guard: GuardThread) -> None:
    sdk = client(guard)
    lines = chat_lines(2) + [{"custom_id": "too-long", "method": "POST", "url": "/v1/chat/completions",
                              "body": {**chat_body(9), "max_tokens": 10**6}}]
    batch = sdk.batches.create(input_file_id=upload(sdk, jsonl(lines)).id, endpoint="/v1/chat/completions",
                               completion_window="24h")
    done = finished(sdk, batch.id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    (error,) = output_of(sdk, done.error_file_id)
    assert error["custom_id"] == "too-long" and error["response"]["status_code"] == 400
    assert error["response"]["body"]["error"]["message"]


def test_a_restart_with_the_embedded_store_resumes(engine: ServerThread, tmp_path: Path) -> None:
    config = guard_config(engine.url, batch={"store": str(tmp_path), "lease_ttl_s": 2, "max_in_flight": 2})
    with usable_guard(config) as first:
        sdk = client(first)
        batch = sdk.batches.create(input_file_id=upload(sdk, jsonl(chat_lines(30, max_tokens=24))).id,
                                   endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(lambda: sdk.batches.retrieve(batch.id).request_counts.completed, lambda n: n >= 3, 30,
                 interval=0.05)
    with sqlite3.connect(tmp_path / "batches.db") as db:
        (recorded,), = db.execute("SELECT count(*) FROM results").fetchall()
    assert 3 <= recorded < 30, "the first guard stopped mid-batch"
    with usable_guard(config) as second:
        sdk = client(second)
        done = finished(sdk, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 30
        out = output_of(sdk, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(30))


def test_a_batch_past_its_window_expires_with_partial_output(engine: ServerThread, tmp_path: Path) -> None:
    config = guard_config(engine.url, batch={"store": str(tmp_path), "max_in_flight": 1})
    with usable_guard(config) as guard:
        sdk = client(guard)
        batch = sdk.batches.create(input_file_id=upload(sdk, jsonl(chat_lines(200, max_tokens=32))).id,
                                   endpoint="/v1/chat/completions", completion_window="2s")
        done = finished(sdk, batch.id)
        assert done.status == "expired" and done.expired_at is not None
        ran = done.request_counts.completed
        out, errors = output_of(sdk, done.output_file_id), output_of(sdk, done.error_file_id)
        assert 1 <= ran < 200 and len(out) == ran and len(errors) == 200 - ran
        assert {e["error"]["code"] for e in errors} == {"batch_expired"} and all(e["response"] is None for e in errors)
        assert sorted(o["custom_id"] for o in out + errors) == sorted(f"req-{i}" for i in range(200))


def test_the_pacer_starts_a_line_only_in_room_other_work_leaves(guard: GuardThread) -> None:
    """One line waiting for its reservation holds the next back, and so does anyone else's queued request."""
    def look() -> list[bool]:
        state = guard.state
        pacer = Pacer(state, max_in_flight=2)
        seen = [pacer.room(), pacer.take("batch_x:1"), pacer.room()]  # idle: room; then one line waits
        pacer.done("batch_x:1")
        seen.append(pacer.room())
        state.dispatcher.fair.queued += 1  # as when a client's request waits in the fair queue
        try:
            seen.append(pacer.room())
        finally:
            state.dispatcher.fair.queued -= 1
        return seen

    assert guard.call(look) == [True, True, False, True, False]


def test_the_pacer_keeps_other_works_recent_peak_free(guard: GuardThread) -> None:
    """Blocks a client's requests reserved at their recent peak stay free for them once they end: a fresh
    pacer would start a line in the emptied pool, one that saw the peak does not."""
    def look() -> list[bool]:
        state = guard.state
        (replica,) = state.pool
        gate, pacer = replica.gate, Pacer(state, max_in_flight=2)
        peak = gate.budget  # the client's requests fill the budget: no line fits beside them
        gate.record("client:1", "acme", peak)
        try:
            seen = [pacer.room()]
        finally:
            gate.release("client:1")
        return [*seen, pacer.room(), Pacer(state, max_in_flight=2).room()]

    assert guard.call(look) == [False, False, True]


def test_other_works_peak_is_the_most_over_its_window() -> None:
    peak = OtherPeak()
    assert [peak.see(0.0, 10), peak.see(1.0, 4), peak.see(2.0, 7)] == [10, 10, 10]
    assert peak.see(PEAK_WINDOW_S + 0.5, 3) == 7, "the 10 left the window; the 7 is the most in it"
    assert peak.see(PEAK_WINDOW_S + 2.5, 0) == 3


class SteepSteps:
    """A replica's latency model whose decode step grows by a tenth of its base with each sequence."""

    def decode_step(self, batch: int) -> float:
        return 1.0 + 0.1 * batch


def test_max_slowdown_holds_the_decode_step_the_batch_adds(guard: GuardThread) -> None:
    """With 10 sequences running, one more line is allowed beside 1 of the guard's lines (11 vs 9 without
    them: 2.1 <= 1.2 x 1.9) and refused beside 4 (11 vs 6: 2.1 > 1.2 x 1.6); without max_slowdown, allowed."""
    def look() -> list[bool]:
        state = guard.state
        (replica,) = state.pool
        gate, latency, snapshot = replica.gate, replica.latency, replica.gate.snapshot
        replica.latency, gate.snapshot = SteepSteps(), snapshot.model_copy(update={"num_running": 10})
        lines = [f"batch_x:{i}" for i in range(4)]
        for key in lines:
            gate.record(key, "bulk", 1)
        try:
            seen = []
            for running, max_slowdown in ((1, 1.2), (4, 1.2), (4, None)):
                pacer = Pacer(state, max_in_flight=8, max_slowdown=max_slowdown)
                pacer.running = set(lines[:running])
                seen.append(pacer.room())
            return seen
        finally:
            for key in lines:
                gate.release(key)
            replica.latency, gate.snapshot = latency, snapshot

    assert guard.call(look) == [True, False, True]
