"""The operator console on the admin listener (guard/console): a real tiny engine, a real guard with its
console, and a real headless Chromium.

- The snapshot (``GET /state``) and the stream (``GET /state/stream``) name the live tenants and the pool's
  numbers after a few requests, carry the event feed (a reload, a refused reload) with each event once, and
  never an API key, the salt secret, or what a refused file said.
- Access: a non-loopback admin listener without ``admin.api_keys`` is refused at config load (and the guard
  exits naming the setting); with keys every endpoint asks for one (Bearer, or HTTP Basic as a browser
  sends it); without keys only loopback host names are answered (no DNS rebinding).
- The page in Chromium: its scripts run without an error, and the tenants' names and the replica's block
  numbers appear in the DOM and keep updating from the stream; no key anywhere in the DOM.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import ValidationError
from support.browser import Chromium
from support.engine_server import ServerThread
from support.guard_server import GuardThread, guard_config
from support.net import request

from guard.__main__ import main as guard_main
from guard.config import ConfigError, load_config
from guard.console.app import CONSOLE
from guard.events import EventLog
from guard.server.reload import reload_file

NUM_BLOCKS = 64
SECRETS = ("sk-acme", "sk-globex", "sk-bulk", "test-secret")  # guard_config's keys and salt secret
ADMIN_KEY = "adm-console-key"


class Stack:
    def __init__(self, engine: ServerThread, guard: GuardThread, config_path: Path) -> None:
        self.engine, self.guard, self.config_path = engine, guard, config_path

    @property
    def console(self) -> str:
        return self.guard.app[CONSOLE].url

    def state(self) -> dict[str, Any]:
        status, body = request(self.console + "/state")
        assert status == 200, body
        assert_no_secret(body.decode())
        return json.loads(body)


def assert_no_secret(text: str) -> None:
    leaked = [secret for secret in (*SECRETS, ADMIN_KEY) if secret in text]
    assert not leaked, f"{leaked} in what the console shows"


def complete(guard: GuardThread, key: str, max_tokens: int = 8) -> None:
    body = json.dumps({"model": "tiny", "prompt": "hello console", "max_tokens": max_tokens,
                       "ignore_eos": True})
    status, answer = request(guard.url + "/v1/completions", body.encode(), {"Authorization": f"Bearer {key}"})
    assert status == 200, answer


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("console")
    with ServerThread(num_blocks=NUM_BLOCKS) as engine:
        config = guard_config(engine.url, root, admin={"host": "127.0.0.1", "port": 0})
        with GuardThread(config) as guard:
            for key in ("sk-acme", "sk-globex", "sk-acme"):
                complete(guard, key)
            yield Stack(engine, guard, root / "guard.yaml")


def test_the_snapshot_names_live_tenants_and_pool_numbers_and_no_key(stack: Stack) -> None:
    state = stack.state()
    tenants = {t["name"]: t for t in state["tenants"]}
    assert list(tenants) == ["acme", "globex", "bulk"]
    assert tenants["acme"]["service"] > tenants["globex"]["service"] > 0 == tenants["bulk"]["service"]
    assert tenants["acme"]["weight_share"] == 0.5 and tenants["bulk"]["lane"] == "batch"
    assert tenants["acme"]["detector"]["state"] == "normal"
    [replica] = state["replicas"]
    blocks = replica["blocks"]
    assert replica["name"] == "primary" and replica["up"] and replica["circuit"] == "closed"
    assert blocks["total"] == NUM_BLOCKS and blocks["used"] + blocks["cached"] + blocks["free"] == NUM_BLOCKS
    assert blocks["budget"] == int(0.85 * NUM_BLOCKS) == state["guard"]["budget_blocks"]
    assert blocks["cached"] > 0, "the requests' prompts stay cached"
    assert state["guard"]["mode"] == "normal"
    for asset in ("/", "/console.js", "/console.css"):
        status, body = request(stack.console + asset)
        assert status == 200
        assert_no_secret(body.decode())


async def test_the_stream_carries_snapshots_and_each_event_once(stack: Stack, tmp_path: Path) -> None:
    state = stack.guard.state
    before = stack.guard.call(lambda: state.events.seq)
    assert stack.guard.call(lambda: reload_file(state, stack.config_path))
    broken = tmp_path / "broken.yaml"  # invalid YAML whose error message would quote the key
    broken.write_text('secret: s\ntenants: [{name: leak, api_keys: ["sk-acme-leak"]\n')
    assert not stack.guard.call(lambda: reload_file(state, broken))
    snapshots = []
    async with aiohttp.ClientSession() as session, session.get(stack.console + "/state/stream") as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        assert (await response.content.readline()).startswith(b"retry: ")
        async for line in response.content:
            assert_no_secret(line.decode())
            if line.startswith(b"data: "):
                snapshots.append(json.loads(line[6:]))
                if len(snapshots) == 3:
                    break
    assert snapshots[-1]["time"] - snapshots[0]["time"] >= 1.5, "about one snapshot a second"
    reloads = [event for snapshot in snapshots for event in snapshot["events"]
               if event["kind"] == "reload" and event["seq"] > before]
    assert [e["result"] for e in reloads] == ["ok", "refused"], "each event once, in order"
    assert reloads[0]["tenants"] == ["acme", "globex", "bulk"]
    assert "sk-acme-leak" not in json.dumps(snapshots)
    assert all(not snapshot["events"] for snapshot in snapshots[1:])
    assert {t["name"] for t in snapshots[-1]["tenants"]} == {"acme", "globex", "bulk"}


def test_the_event_log_is_a_bounded_ring_numbered_for_readers() -> None:
    log = EventLog(capacity=3)
    for i in range(5):
        log.record("mode", now=str(i))
    assert [e["seq"] for e in log.since(0)] == [3, 4, 5] and log.since(4) == [log.events[-1]]
    log.track("replica", "e0", "up", initial="up")
    log.track("replica", "e0", "down", initial="up")
    log.track("replica", "e0", "down", initial="up")
    assert log.events[-1] | {"time": 0} == {"seq": 6, "time": 0, "kind": "replica", "subject": "e0",
                                            "state": "down", "was": "up"}
    assert log.seq == 6


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "console.example", "::"])
def test_a_non_loopback_admin_listener_without_a_key_is_refused(host: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    guard_config("http://127.0.0.1:1", admin={"host": host, "port": 8001, "api_keys": [ADMIN_KEY]})
    with pytest.raises(ValidationError, match="admin.api_keys"):
        guard_config("http://127.0.0.1:1", tmp_path, admin={"host": host, "port": 8001})  # file written first
    path = tmp_path / "guard.yaml"
    with pytest.raises(ConfigError, match=r"admin: .*admin\.api_keys"):
        load_config(path)
    assert guard_main(["--config", str(path)]) == 2
    assert "admin.api_keys" in capsys.readouterr().err


def test_loopback_needs_no_key_and_an_admin_key_must_be_no_tenants() -> None:
    for host in ("127.0.0.1", "localhost", "::1"):
        guard_config("http://127.0.0.1:1", admin={"host": host, "port": 8001})
    with pytest.raises(ValidationError, match="must not also be a tenant's"):
        guard_config("http://127.0.0.1:1", admin={"host": "0.0.0.0", "port": 8001, "api_keys": ["sk-acme"]})


async def test_with_admin_keys_every_endpoint_asks_for_one(stack: Stack) -> None:
    config = guard_config(stack.engine.url, admin={"host": "127.0.0.1", "port": 0, "api_keys": [ADMIN_KEY]})
    basic = base64.b64encode(f"operator:{ADMIN_KEY}".encode()).decode()
    with GuardThread(config) as guard:
        url = guard.app[CONSOLE].url
        async with aiohttp.ClientSession() as session:
            for path, found in (("/", 200), ("/console.js", 200), ("/state", 200), ("/state/stream", 200),
                                ("/events", 200), ("/requests", 200), ("/requests/req-unknown", 404)):
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {ADMIN_KEY}x"},
                                {"Authorization": f"Basic {ADMIN_KEY}"}):
                    async with session.get(url + path, headers=headers) as response:
                        assert response.status == 401, (path, headers)
                        assert response.headers["WWW-Authenticate"].startswith("Basic realm=")
                for headers in ({"Authorization": f"Bearer {ADMIN_KEY}"},
                                {"Authorization": f"Basic {basic}"}):
                    async with session.get(url + path, headers=headers) as response:
                        assert response.status == found, (path, headers)
                        assert_no_secret((await response.content.readany()).decode())


async def test_without_keys_only_loopback_host_names_are_answered(stack: Stack) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(stack.console + "/state", headers={"Host": "rebound.example"}) as response:
            assert response.status == 403
        async with session.get(stack.console + "/state", headers={"Host": "localhost:1"}) as response:
            assert response.status == 200


async def test_the_page_shows_live_tenants_and_pool_numbers_in_chromium(stack: Stack, tmp_path: Path) -> None:
    async with Chromium(tmp_path) as page:
        await page.navigate(stack.console + "/")
        await page.wait_for("document.querySelectorAll('#tenants tbody tr').length === 3")
        first = float(await page.evaluate("document.body.dataset.updated"))
        complete(stack.guard, "sk-bulk")  # the page hears of these from the stream
        stack.guard.call(lambda: reload_file(stack.guard.state, stack.config_path))
        await page.wait_for(f"document.body.dataset.updated > {first + 1}")
        await page.wait_for("document.querySelector('#events li[data-kind=reload]') !== null")
        text = await page.evaluate("document.body.innerText")
        for name in ("acme", "globex", "bulk", "primary"):
            assert name in text
        card = await page.evaluate("document.querySelector('[data-replica=primary]').innerText")
        assert f"total {NUM_BLOCKS}" in card and f"budget {int(0.85 * NUM_BLOCKS)}" in card, card
        assert "up" in card and "circuit closed" in card
        # bulk's share of the service the page has seen (it opened before bulk's request) next to its weight's
        share = await page.wait_for("(note => !note.startsWith('0') && note)(document.querySelector("
                                    "'[data-tenant=bulk] .share + .note').textContent)")
        assert share == "100% vs 25%"
        assert "batch" in await page.evaluate("document.querySelector('[data-tenant=bulk]').innerText")
        assert await page.evaluate("document.getElementById('connection').textContent") == "live"
        # The recent requests, bulk's among them; a click shows its decision record.
        row = "document.querySelector('#requests tbody tr[data-request] td:nth-child(2)')"
        await page.wait_for(f"{row} !== null && {row}.textContent === 'bulk'")
        request_id = await page.evaluate(f"{row}.parentElement.dataset.request")
        await page.evaluate(f"{row}.parentElement.click()")
        await page.wait_for(f"document.getElementById('record').dataset.request === {json.dumps(request_id)}")
        shown = json.loads(await page.evaluate("document.getElementById('record').textContent"))
        assert shown["request_id"] == request_id and shown["tenant"] == "bulk" and shown["replica"] == "primary"
        assert [stage["name"] for stage in shown["stages"]][-1] == "forward"
        assert_no_secret(await page.evaluate("document.documentElement.outerHTML"))
        assert page.errors == []
