"""SIGHUP reload and the secret (issue 16), against a real guard process in front of the real tiny engine.

- A 300-token stream on a key the new file removes runs through the reload and ends with ``[DONE]``; from
  the reload on, that key gets 401 and the new keys are served as their tenants.
- A file that does not load (invalid YAML, an unknown key), or that changes a key only a restart may change,
  is refused: logged with the problem, counted as ``result="invalid"``, and the guard serves on with the old
  keys (a key the refused file adds is refused).
- The placeholder secret stops ``python -m guard`` with exit status 2 and a message naming ``secret`` and
  ``KVGUARD_SECRET``; ``KVGUARD_SECRET`` in the environment satisfies it.
- In process, without a signal: a removed tenant's queued request is still admitted, with the tenant and
  lane it came with, and its queue goes once it holds nothing; a kept tenant keeps its verdict.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.engine_server import ServerThread
from support.guard_server import guard_config
from support.net import free_port, request
from support.nothing_lost import Client, Tally, assert_openai_error
from support.processes import GuardProcess, Processes, run_command
from support.wait import until

from engine.protocol import TelemetrySnapshot
from guard.admission.ticket import Ticket, TicketState
from guard.config import config_hash
from guard.instance import STATE
from guard.server.app import create_app
from guard.server.reload import apply, reload_file

STREAM = {"model": "tiny", "prompt": "hello", "max_tokens": 300, "ignore_eos": True, "stream": True,
          "stream_options": {"include_usage": True}}
SHORT = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
# The reload's file: acme and its key go; globex gets a second key; initech arrives; bulk weighs more.
NEW_TENANTS = [
    {"name": "globex", "api_keys": ["sk-globex", "sk-globex-2"], "weight": 1, "lane": "interactive"},
    {"name": "bulk", "api_keys": ["sk-bulk"], "weight": 3, "lane": "batch", "max_queue": 256},
    {"name": "initech", "api_keys": ["sk-initech"], "weight": 2, "lane": "agent"},
]


@pytest.fixture(scope="module")
def engine() -> Iterator[ServerThread]:
    with ServerThread() as server:
        yield server


def scrape(url: str) -> dict[str, float]:
    """Every series of the guard's /metrics: ``name{labels}`` -> value."""
    lines = request(url + "/metrics")[1].decode().splitlines()
    return {series: float(value) for series, _, value in (line.rpartition(" ") for line in lines
                                                          if line and not line.startswith("#"))}


def reloads(result: str) -> str:
    return f'guard_config_reloads_total{{result="{result}"}}'


def start_guard(engine: ServerThread, tmp_path: Path, processes: Processes) -> tuple[GuardProcess, dict]:
    """A guard process on ``tmp_path / "guard.yaml"`` (acme, globex, bulk) and its listen address."""
    listen = {"host": "127.0.0.1", "port": free_port()}
    guard_config(engine.url, tmp_path, listen=listen)
    return processes.guard(tmp_path / "guard.yaml"), listen


async def test_sighup_swaps_keys_while_a_300_token_stream_on_a_removed_key_finishes(
        engine: ServerThread, tmp_path: Path, processes: Processes) -> None:
    guard, listen = start_guard(engine, tmp_path, processes)
    old_hash = config_hash(guard_config(engine.url, listen=listen))
    client = Client(guard.url, Tally())
    started = asyncio.Event()
    stream = asyncio.create_task(client.call(STREAM, key="sk-acme", started=started))
    await asyncio.wait_for(started.wait(), 30)  # the stream's first token has arrived

    new = guard_config(engine.url, tmp_path, listen=listen, tenants=NEW_TENANTS)
    guard.send_signal(signal.SIGHUP)
    series = await until(lambda: scrape(guard.url), lambda s: s[reloads("ok")] == 1, 10, message=guard.log_tail)
    # One scrape, after the reload: acme is gone from the file, and its stream still holds its blocks.
    assert not stream.done() and series['guard_reserved_blocks{tenant="acme"}'] > 0, "the stream ended too soon"
    assert series[f'guard_config_info{{hash="{config_hash(new)}"}}'] == 1
    assert f'guard_config_info{{hash="{old_hash}"}}' not in series and series[reloads("invalid")] == 0

    assert_openai_error(await client.call(SHORT, key="sk-acme"), 401, "invalid_api_key")
    for key, tenant in (("sk-initech", "initech"), ("sk-globex-2", "globex"), ("sk-globex", "globex")):
        answer = await client.call(SHORT, key=key)
        assert (answer.status, answer.headers["X-Guard-Tenant"]) == (200, tenant), answer.body[:300]

    answer = await asyncio.wait_for(stream, 60)
    events = answer.events()
    assert answer.status == 200 and events[-1] == b"data: [DONE]", events[-3:]
    assert json.loads(events[-2].removeprefix(b"data: "))["usage"]["completion_tokens"] == 300
    # acme's queue went with its last request: no series of it is left, and initech has its own.
    series = await until(lambda: scrape(guard.url), lambda s: 'guard_queue_depth{tenant="acme"}' not in s, 5)
    assert 'guard_fill_squeeze_state{tenant="acme"}' not in series
    assert series['guard_fill_squeeze_state{tenant="initech"}'] == 0 and 'guard_queue_depth{tenant="initech"}' in series
    assert "config reloaded" in guard.log_text()


async def test_a_broken_file_on_sighup_keeps_the_guard_serving_with_the_old_config(
        engine: ServerThread, tmp_path: Path, processes: Processes) -> None:
    guard, listen = start_guard(engine, tmp_path, processes)
    path = tmp_path / "guard.yaml"
    raw = yaml.safe_load(path.read_text())
    hash_label = f'guard_config_info{{hash="{config_hash(guard_config(engine.url, listen=listen))}"}}'
    newcomer = {"name": "initech", "api_keys": ["sk-new"]}  # each broken file adds it: it must not come in
    broken = {
        "invalid YAML": ("tenants: [{name: initech, api_keys: [sk-new]}\n", "invalid YAML"),
        "unknown key": (yaml.safe_dump({**raw, "tenants": [*raw["tenants"], {**newcomer, "wieght": 2}]}),
                        "tenants.3.wieght: unknown key 'wieght'"),
        "restart-only key": (yaml.safe_dump({**raw, "listen": {**listen, "port": free_port()},
                                             "tenants": [*raw["tenants"], newcomer]}),
                             "listen: cannot change without a restart"),
    }
    client = Client(guard.url, Tally())
    for count, (name, (text, problem)) in enumerate(broken.items(), 1):
        path.write_text(text)
        guard.send_signal(signal.SIGHUP)
        series = await until(lambda: scrape(guard.url), lambda s, n=count: s[reloads("invalid")] == n, 10,
                             message=guard.log_tail)
        assert series[reloads("ok")] == 0 and series[hash_label] == 1, name
        assert series["guard_config_last_reload_successful"] == 0, name
        await until(guard.log_text, lambda log, p=problem: p in log, 5, message=guard.log_tail)
        assert "config reload refused" in guard.log_text(), name
        answer = await client.call(SHORT, key="sk-acme")
        assert (answer.status, answer.headers["X-Guard-Tenant"]) == (200, "acme"), (name, answer.body[:300])
        assert_openai_error(await client.call(SHORT, key="sk-new"), 401, "invalid_api_key")
    path.write_text(yaml.safe_dump(raw))  # fixed: applied, and the last reload worked again
    guard.send_signal(signal.SIGHUP)
    series = await until(lambda: scrape(guard.url), lambda s: s[reloads("ok")] == 1, 10, message=guard.log_tail)
    assert series["guard_config_last_reload_successful"] == 1
    assert guard.poll() is None


async def test_the_placeholder_secret_is_refused_and_kvguard_secret_satisfies_it(
        engine: ServerThread, tmp_path: Path, processes: Processes) -> None:
    listen = {"host": "127.0.0.1", "port": free_port()}
    guard_config(engine.url, tmp_path, listen=listen)
    raw = yaml.safe_load((tmp_path / "guard.yaml").read_text())
    files = {"left out": tmp_path / "no-secret.yaml", "spelled out": tmp_path / "placeholder.yaml"}
    files["left out"].write_text(yaml.safe_dump({k: v for k, v in raw.items() if k != "secret"}))
    files["spelled out"].write_text(yaml.safe_dump({**raw, "secret": "change-me"}))
    env = {k: v for k, v in os.environ.items() if k != "KVGUARD_SECRET"}

    async def start(path: Path) -> Any:
        return await asyncio.to_thread(run_command, sys.executable, "-m", "guard", "--config", path, env=env,
                                       timeout=30)

    for name, done in zip(files, await asyncio.gather(*(start(path) for path in files.values())), strict=True):
        assert done.returncode == 2, (name, done.stdout, done.stderr)
        assert done.stderr.startswith("guard: invalid configuration: "), (name, done.stderr)
        assert "secret: " in done.stderr and "KVGUARD_SECRET" in done.stderr and "Traceback" not in done.stderr

    guard = processes.guard(files["left out"], env={**env, "KVGUARD_SECRET": os.urandom(16).hex()})
    answer = await Client(guard.url, Tally()).call(SHORT, key="sk-acme")
    assert answer.status == 200, answer.body[:300]


async def test_a_removed_tenant_finishes_what_it_has_queued_then_its_queue_goes(
        engine: ServerThread, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """In process: ``apply`` as SIGHUP runs it, and ``reload_file`` refusing a change only a restart makes."""
    tenants = [{"name": "acme", "api_keys": ["sk-acme"], "max_blocks_share": 0.1},
               {"name": "globex", "api_keys": ["sk-globex"]}]
    config = guard_config(engine.url, tmp_path, tenants=tenants)
    state = create_app(config)[STATE]
    gate = state.pool.replicas[0].gate
    gate.update(TelemetrySnapshot.model_validate(engine.telemetry()))
    acme, lane = config.tenants[0], config.lanes["interactive"]
    cap = int(0.1 * state.pool.budget())
    running, queued = (Ticket(rid, acme, lane, 10, 10, cap) for rid in ("running", "queued"))
    await state.dispatcher.submit(running)
    waiting = asyncio.create_task(state.dispatcher.submit(queued))
    await asyncio.sleep(0)
    assert running.state is TicketState.ADMITTED and queued.state is TicketState.QUEUED, "held by acme's cap"
    state.detector.tenants["globex"].state = "suspect"  # a verdict a reload must not launder

    new = guard_config(engine.url, tenants=[{"name": "globex", "api_keys": ["sk-globex", "sk-new"], "weight": 3},
                                            {"name": "initech", "api_keys": ["sk-initech"], "lane": "batch"}])
    apply(state, new)
    assert state.config is new and state.dispatcher.total_weight == 4
    assert state.keys.tenant_for("Bearer sk-acme") is None and state.keys.tenant_for("Bearer sk-new").name == "globex"
    assert state.dispatcher.fair.tenants["globex"].weight == 3 and state.detector.weights == {"globex": 3, "initech": 1}
    assert state.detector.state("globex") == "suspect" and state.detector.state("initech") == "normal"
    assert state.dispatcher.retired == {"acme"} and "acme" in gate.guard_tenants

    state.dispatcher.finish(running)  # acme's cap has room again: its queued request goes in, as it came
    await asyncio.wait_for(waiting, 1)
    assert queued.state is TicketState.ADMITTED and (queued.tenant, queued.lane) == (acme, lane)
    state.dispatcher.finish(queued)
    assert "acme" not in state.dispatcher.fair.tenants and "acme" not in gate.guard_tenants
    assert not state.dispatcher.retired
    # A request authenticated before the reload that reaches admission only now is still served, and leaves
    # nothing behind.
    late = Ticket("late", acme, lane, 10, 10, 1)
    await state.dispatcher.submit(late)
    assert late.state is TicketState.ADMITTED
    state.dispatcher.finish(late)
    assert "acme" not in state.dispatcher.fair.tenants and not state.pool.reservations()

    path = tmp_path / "guard.yaml"
    guard_config(engine.url, tmp_path, tenants=NEW_TENANTS, secret="another-secret",
                 admission={"safe_utilization": 0.5})
    with caplog.at_level(logging.ERROR, logger="guard.server.reload"):
        assert not reload_file(state, path)
    assert "admission, secret: cannot change without a restart" in caplog.text
    assert "another-secret" not in caplog.text and state.config is new
    assert state.metrics.registry.get_sample_value("guard_config_reloads_total", {"result": "invalid"}) == 1
