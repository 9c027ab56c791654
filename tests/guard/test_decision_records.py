"""Decision records (guard/records/, guard/http/decision.py): every request's record on the admin listener,
live through a guard in front of two real tiny engines, and the store, the log and the request-id rule on
their own."""

from __future__ import annotations

import gc
import json
from array import array
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from multidict import CIMultiDict
from support.admission_parts import BASE, write
from support.guard_server import GuardThread, guard_config
from support.processes import EngineProcess, Processes
from support.wait import until

from guard.config import ConfigError, load_config
from guard.console.app import CONSOLE
from guard.http.routes import request_id_of
from guard.instance import STATE
from guard.records.log import DecisionLog
from guard.records.record import DecisionRecord, Shed, pack, unpack, values_of
from guard.records.store import SLOT_BYTES, RecordStore
from guard.server.app import create_app
from guard.server.reload import restart_only_changes

KEYS = {"request_id", "tenant", "lane", "model", "status", "outcome", "replica", "replicas", "queue_ms", "ttft_ms", "stages",
        "candidates", "reservation", "prefix", "usage", "shed", "time", "slo", "priority_class", "objective"}
POOL_STAGES = ["auth", "validate", "route", "count", "size", "ticket", "limits", "queue", "forward"]
PROMPT = "a decision record keeps names and numbers, never the words of a prompt. " * 6  # 408 tokens


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    with Processes(tmp_path_factory.mktemp("records")) as processes:
        spawned = [processes.engine("--num-blocks", "256", name=f"e{i}", wait=False) for i in range(2)]
        yield [engine.wait_ready() for engine in spawned]


def records_guard(engines: list[EngineProcess], tmp_path: Path) -> GuardThread:
    tenants = [{"name": "acme", "api_keys": ["sk-acme"], "lane": "interactive"},
               {"name": "limited", "api_keys": ["sk-limited"], "lane": "batch", "rpm": 1}]
    return GuardThread(guard_config([e.url for e in engines], admin={"host": "127.0.0.1", "port": 0},
                                    tenants=tenants, decision_log=str(tmp_path / "decisions.jsonl")))


async def post(session: aiohttp.ClientSession, guard: GuardThread, body: dict, key: str = "sk-acme",
               request_id: str | None = None) -> tuple[aiohttp.ClientResponse, bytes]:
    headers = {"Authorization": f"Bearer {key}"} | ({"X-Request-Id": request_id} if request_id else {})
    async with session.post(guard.url + "/v1/completions", json=body, headers=headers) as response:
        return response, await response.read()


async def record_of(session: aiohttp.ClientSession, guard: GuardThread, request_id: str) -> dict:
    async with session.get(f"{guard.app[CONSOLE].url}/requests/{request_id}") as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_every_request_has_a_record_that_says_what_was_decided(engines, tmp_path: Path) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8}
    with records_guard(engines, tmp_path) as guard:
        await until(lambda: guard.call(lambda: all(r.usable() and r.index.synced for r in guard.state.pool)),
                    bool, 15.0)
        async with aiohttp.ClientSession() as session:
            for attempt in range(2):  # the second finds the prompt cached: both must report what the engine did
                response, raw = await post(session, guard, body, request_id=f"client-id-{attempt}")
                assert response.status == 200 and response.headers["X-Request-Id"] == f"client-id-{attempt}"
                usage = json.loads(raw)["usage"]
                record = await record_of(session, guard, f"client-id-{attempt}")
                assert set(record) == KEYS
                assert (record["tenant"], record["lane"], record["model"], record["status"], record["outcome"]) == \
                    ("acme", "interactive", "tiny", 200, "completed")
                assert record["replica"] == response.headers["X-Guard-Backend"]
                assert [s["name"] for s in record["stages"]] == POOL_STAGES and all(s["ms"] >= 0 for s in record["stages"])
                assert sorted(c["replica"] for c in record["candidates"]) == ["e0", "e1"]
                assert all(set(c) == {"replica", "filtered_by", "scores", "total"} and
                           set(c["scores"]) == {"prefix", "free_blocks", "idle"} for c in record["candidates"])
                assert record["reservation"]["blocks"] > 0 and record["reservation"]["tokens"] == 8
                assert record["reservation"]["borrowed"] >= 0 and record["reservation"]["growths"] == 0
                assert record["prefix"]["reported_hit_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
                assert record["usage"] == {"prompt_tokens": usage["prompt_tokens"],
                                           "completion_tokens": usage["completion_tokens"]}
                assert record["queue_ms"] >= 0 and record["ttft_ms"] is None and record["shed"] is None
                text = json.dumps(record)
                assert "decision record keeps" not in text and "sk-acme" not in text
                index = guard.state.pool.by_name[record["replica"]].index
                await until(lambda: guard.call(lambda: len(index)), lambda n: n >= 25, 10.0)  # noqa: B023
            assert record["prefix"]["predicted_hit_tokens"] > 0  # the second: its replica's index had the prompt

            # The client asks for usage here: sampling may end the stream early (EOS), so the record must say
            # what the engine reported for this stream, not max_tokens.
            async with session.post(guard.url + "/v1/completions",
                                    json={**body, "stream": True, "stream_options": {"include_usage": True}},
                                    headers={"Authorization": "Bearer sk-acme"}) as response:
                assert response.status == 200
                streamed = response.headers["X-Request-Id"]
                events = [json.loads(line[5:]) for line in (await response.read()).split(b"\n")
                          if line.startswith(b"data:") and b"[DONE]" not in line]
            streamed_usage = next(e["usage"] for e in events if e.get("usage"))
            record = await record_of(session, guard, streamed)
            assert record["ttft_ms"] > 0
            assert record["usage"]["completion_tokens"] == streamed_usage["completion_tokens"] > 0

            await post(session, guard, body, key="sk-limited")
            response, _ = await post(session, guard, body, key="sk-limited", request_id="over-rpm")
            assert response.status == 429
            shed = (await record_of(session, guard, "over-rpm"))["shed"]
            assert (shed["stage"], shed["status"], shed["code"]) == ("limits", 429, "rate_limit_exceeded")
            assert "rpm" in shed["message"]
            response, _ = await post(session, guard, {"model": "tiny", "prompt": PROMPT, "max_tokens": -3},
                                     request_id="invalid")
            invalid = await record_of(session, guard, "invalid")
            assert response.status == 400 and invalid["shed"]["stage"] == "validate"
            assert invalid["shed"]["message"] is None and invalid["reservation"]["blocks"] is None
            response, _ = await post(session, guard, body, key="sk-unknown", request_id="who")
            assert response.status == 401 and (await record_of(session, guard, "who"))["shed"]["stage"] == "auth"

            response, _ = await post(session, guard, body, request_id="not a sane id")
            assert response.headers["X-Request-Id"].startswith("req-")
            async with session.get(f"{guard.app[CONSOLE].url}/requests/nothing-by-that-id") as missing:
                assert missing.status == 404
            async with session.get(f"{guard.app[CONSOLE].url}/requests?limit=3") as recent:
                listed = (await recent.json())["requests"]
            assert [r["request_id"] for r in listed][1:] == ["who", "invalid"] and len(listed) == 3
    lines = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and lines[0]["request_id"] == "client-id-0" and set(lines[0]) == KEYS


async def test_a_finished_request_leaves_nothing_to_the_cycle_collector(engines, tmp_path: Path) -> None:
    """Every guard object of a request is freed when it ends, by reference counting: a cycle (the context
    holding its ticket, the ticket calling back into the context) made each wait for the collector, and
    cost a fifth more CPU per request (docs/benchmarks.md, "Guard cost")."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4}
    with records_guard(engines, tmp_path) as guard:
        async with aiohttp.ClientSession() as session:
            for _ in range(3):  # warm: first-request caches, lazily built objects
                await post(session, guard, body)
            gc.collect()
            gc.disable()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for stream in (False, True, False, True):
                    response, _ = await post(session, guard, {**body, "stream": stream})
                    assert response.status == 200
                gc.collect()
                left = Counter(type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("guard."))
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
                gc.enable()
    assert left == Counter()


def a_record(request_id: str) -> DecisionRecord:
    return DecisionRecord(request_id, "acme", "batch", "tiny", 429, "rejected_quota", None, 10.0, 10.00021, 0.0,
                          ["auth", "limits"], [10.0, 10.00001], (), shed=Shed("limits", 429, "rate_limit_exceeded", "x"))


def keep(store: RecordStore, record: DecisionRecord) -> None:
    store.put(record.request_id, pack(values_of(record)))


def test_the_store_keeps_the_newest_and_a_reused_id_shows_its_newest_record() -> None:
    store = RecordStore(capacity=3)
    assert store.recent(5) == [] and store.get("r0") is None and len(store) == 0
    for i in range(5):
        keep(store, a_record(f"r{i}"))
    assert len(store) == 3 and store.get("r1") is None and store.get("r2") is not None
    assert [r.request_id for r in store.recent(10)] == ["r4", "r3", "r2"]
    reused = a_record("r3")
    reused.status = 200
    keep(store, reused)  # in r2's slot; r3's older record stays in its own, unseen
    assert store.get("r2") is None and store.get("r3").status == 200 and len(store) == 2
    assert [(r.request_id, r.status) for r in store.recent(10)] == [("r3", 200), ("r4", 429)]
    assert [r.request_id for r in store.recent(1)] == ["r3"] and store.recent(0) == []
    keep(store, a_record("r5"))  # in the older r3's slot: the newer one is still found
    assert store.get("r3").status == 200 and [r.request_id for r in store.recent(10)] == ["r5", "r3", "r4"]


def test_a_kept_record_reads_back_whole_and_shares_nothing_with_the_request() -> None:
    """Packed as it is kept: every field comes back equal, the candidates, objective and refusal included,
    and what the request's objects do afterwards does not reach it."""
    record = a_record("r")
    record.candidates = [("e1", None, {"prefix": 0.5}, 0.5)]
    record.slo, record.replicas = {"ttft_ms": 500.0, "met": {"ttft": True}}, ("e0", "e1")
    record.stage_starts = array("d", record.stage_starts)
    store = RecordStore(capacity=2)
    keep(store, record)
    assert store.get("r") == record == unpack(pack(values_of(record)))
    record.stage_names.append("forward")
    record.candidates[0][2]["prefix"] = 0.9
    assert store.get("r").stage_names == ["auth", "limits"] and store.get("r").candidates[0][2] == {"prefix": 0.5}


def test_a_record_larger_than_a_slot_or_with_an_unusual_id_is_kept_too() -> None:
    store = RecordStore(capacity=3)
    large = a_record("large")
    large.shed = Shed("limits", 429, "rate_limit_exceeded", "m" * SLOT_BYTES)
    for record in (large, a_record("r\u00e9q"), a_record("a")):
        keep(store, record)
    assert store.get("large").shed.message == "m" * SLOT_BYTES and store.get("r\u00e9q") is not None
    assert store.get("a").request_id == "a" and store.get("acm") is None and store.get("") is None
    assert [r.request_id for r in store.recent(3)] == ["a", "r\u00e9q", "large"]
    keep(store, a_record("after"))  # in the large one's slot: what was kept beside the ring goes with it
    assert store.get("large") is None and not store._beside and store.get("after") is not None


def test_the_log_writes_one_line_per_record_and_rotates_by_size(tmp_path: Path) -> None:
    log = DecisionLog(tmp_path / "d.jsonl", max_bytes=2000, backups=2)
    for i in range(40):
        log.add(pack(values_of(a_record(f"r{i}"))))
    log.close()
    files = sorted(tmp_path.iterdir())
    assert [f.name for f in files] == ["d.jsonl", "d.jsonl.1", "d.jsonl.2"]
    assert all(f.stat().st_size <= 2000 for f in files)
    newest = [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert newest[-1]["request_id"] == "r39" and newest[-1]["shed"]["stage"] == "limits"
    assert newest[-1]["stages"] == [{"name": "auth", "ms": 0.01}, {"name": "limits", "ms": 0.2}]


def test_to_dict_has_exactly_the_contracts_keys() -> None:
    candidate = ("e1", "saturation", {"prefix": 0.5, "idle": 1.0}, 2.0)
    record = DecisionRecord("r", "acme", "interactive", "tiny", 200, "completed", "e0", 1.0, 1.5, 1.25,
                            ["auth", "forward"], [1.0, 1.125], [candidate], blocks=3, tokens=8, borrowed=0,
                            predicted_hit_tokens=32, reported_hit_tokens=16, prompt_tokens=40, completion_tokens=8)
    shown = record.to_dict()
    assert set(shown) == KEYS and shown["shed"] is None
    assert (shown["queue_ms"], shown["ttft_ms"]) == (125.0, 250.0)
    assert shown["stages"] == [{"name": "auth", "ms": 125.0}, {"name": "forward", "ms": 375.0}]
    assert shown["candidates"] == [{"replica": "e1", "filtered_by": "saturation", "scores": {"prefix": 0.5, "idle": 1.0},
                                    "total": 2.0}]
    assert shown["reservation"] == {"blocks": 3, "tokens": 8, "borrowed": 0, "growths": 0}
    assert shown["prefix"] == {"predicted_hit_tokens": 32, "reported_hit_tokens": 16}
    assert shown["usage"] == {"prompt_tokens": 40, "completion_tokens": 8}
    assert set(a_record("r").to_dict()["shed"]) == {"stage", "status", "code", "message"}


@pytest.mark.parametrize(("given", "kept"), [
    ("abc-123", True), ("trace:1.2_x-Y", True), ("a" * 128, True),
    ("a" * 129, False), ("has space", False), ("r\u00e9q-1", False), ("", False), ("a/b", False), ("a\tb", False),
])
def test_a_clients_request_id_is_kept_only_when_it_is_a_sane_token(given: str, kept: bool) -> None:
    chosen = request_id_of(SimpleNamespace(headers=CIMultiDict({"x-request-id": given})))
    assert (chosen == given) is kept
    if not kept:
        assert chosen.startswith("req-") and len(chosen) == 20


def test_a_request_without_an_id_gets_a_fresh_one() -> None:
    ids = {request_id_of(SimpleNamespace(headers=CIMultiDict())) for _ in range(3)}
    assert len(ids) == 3 and all(i.startswith("req-") for i in ids)


@pytest.mark.parametrize("where", ["{tmp}", "{tmp}/absent/d.jsonl"])  # a directory; a missing one
def test_a_decision_log_path_is_checked_with_the_config(tmp_path: Path, where: str) -> None:
    path = write(tmp_path, BASE + f"decision_log: {where.format(tmp=tmp_path)}\n")
    with pytest.raises(ConfigError, match="decision_log: .*must be a file in an existing directory"):
        load_config(path)


def test_a_log_that_cannot_be_opened_names_the_key_and_the_path(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()  # a directory where the file should be
    with pytest.raises(OSError, match=f"decision_log {tmp_path / 'taken'}: cannot open"):
        DecisionLog(tmp_path / "taken")


def test_a_record_that_cannot_be_written_does_not_stop_the_writer(tmp_path: Path) -> None:
    log = DecisionLog(tmp_path / "d.jsonl")
    bad = a_record("bad")
    bad.candidates = [("e1", None, {"prefix": "not a number"}, 0.0)]  # to_dict cannot round it
    for record in (a_record("before"), bad, a_record("after")):
        log.add(pack(values_of(record)))
    log.close()
    assert [json.loads(line)["request_id"] for line in (tmp_path / "d.jsonl").read_text().splitlines()] == \
        ["before", "after"]


def test_each_worker_writes_its_own_file_and_keeps_the_path_it_was_given(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, BASE + f"decision_log: {tmp_path / 'decisions.jsonl'}\n"))
    state = create_app(config, worker=1)[STATE]
    try:
        assert state.decision_log.path == tmp_path / "decisions.worker1.jsonl" and state.decision_log.path.exists()
        assert restart_only_changes(state.config, load_config(tmp_path / "guard.yaml")) == []  # a reload can apply
    finally:
        state.decision_log.close()
