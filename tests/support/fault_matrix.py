"""The fleet fault matrix (issue 29): two guards sharing state through a real Redis, in front of real engines,
under one fault per cell; what each cell measured, and the checks every cell ends with.

``Fleet`` is what the cells share (one per module: starting engines is the slow part): Redis, engine ``e0``
and engine ``e1`` behind a ``BlackHole`` relay, each a real process with a small pool, so that two guards
with one busy tenant each contend for it. Each cell starts two fresh guards (tenant ``a`` floods the first,
``b`` the second), runs its fault while both flood, and returns a ``Row``:

- ``preemptions``: engine preemptions during the cell (0 wherever the guards could know);
- ``ok`` / ``refused`` / ``lost``: whole answers; explicit errors (an OpenAI error with its status, or a
  stream that ends with an ``error`` event); and anything else: a hang past the client's deadline, a reset,
  a truncated body. ``cut``: requests in flight at a guard the cell SIGKILLed, which die with it by design;
- ``over_budget``: the largest excess, in blocks, of the guards' reservations on one engine over its pool,
  sampled every 20 ms (0: the guards never promised more than the engine holds);
- ``blocks_back`` / ``reservations_back``: after the cell, every engine idle with every block free or
  cached, and every live guard holding no reservation and queueing nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

import aiohttp
import redis as redis_client
import yaml

from guard.config import GuardConfig

from .blackhole import BlackHole
from .guard_server import GuardThread
from .net import free_port, request
from .netns import Netns
from .nothing_lost import guard_holds_nothing, idle_and_free
from .processes import EngineProcess, GuardProcess
from .redis_server import RedisServer
from .wait import wait_for

TENANTS = [{"name": "a", "api_keys": ["sk-a"], "weight": 1}, {"name": "b", "api_keys": ["sk-b"], "weight": 1}]
NUM_BLOCKS = 48  # per engine: 12 streams of 4 blocks per guard want all of both engines' budgets
STREAMS = 12  # per guard
CLIENT_DEADLINE_S = 20.0  # a request with no whole answer by then counts as lost (hung)


@dataclass(slots=True)
class Row:
    cell: str
    preemptions: int = 0
    ok: int = 0
    refused: int = 0
    lost: int = 0
    cut: int = 0
    over_budget: int = 0
    blocks_back: bool = False
    reservations_back: bool = False
    errors: dict[str, int] = field(default_factory=dict)  # refusals and losses by kind, for the report

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Fleet:
    """Redis, engine e0 and engine e1 (behind a black-hole relay), for the length of a ``with``."""

    def __init__(self, root: Path, seconds: float = 3.0, redis_netns: Netns | None = None) -> None:
        self.root = root
        self.seconds = seconds  # of load per cell
        self.redis_netns = redis_netns  # Redis runs in it: the link to it can be cut (``redis_link_cut``)
        self.redis = RedisServer(root, netns=redis_netns)
        self.e0 = EngineProcess("--num-blocks", str(NUM_BLOCKS), name="e0", log=root / "e0.log")
        self.e1 = EngineProcess("--num-blocks", str(NUM_BLOCKS), name="e1", log=root / "e1.log")
        self.hole: BlackHole | None = None

    def __enter__(self) -> Self:
        self.redis.start()
        self.e0.spawn()
        self.e1.spawn()
        self.e0.wait_ready()
        self.e1.wait_ready()
        self.hole = BlackHole(self.e1.port).__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.hole is not None:
            self.hole.__exit__()
        for process in (self.e1, self.e0, self.redis):
            process.close()

    @property
    def engines(self) -> list[EngineProcess]:
        return [self.e0, self.e1]

    def guard_config(self, name: str, engine_urls: list[str] | None = None) -> dict[str, Any]:
        urls = engine_urls or [self.e0.url, self.hole.url if self.hole is not None else ""]
        return {"listen": {"host": "127.0.0.1", "port": free_port()}, "secret": f"fleet-{name}",
                "engines": [{"name": f"e{i}", "url": url} for i, url in enumerate(urls)],
                "upstream": {"connect_timeout": 1.0, "first_token_timeout": 3.0, "idle_timeout": 3.0},
                "tenants": TENANTS, "shared_state": {"redis_url": self.redis.url, "lease_ttl_s": 3}}

    def preemptions(self) -> int:
        return sum(_telemetry(engine.url)["preemptions_total"] for engine in self.engines if engine.poll() is None)

    def redis_up(self) -> None:
        """Redis back (empty, as one that lost its data), if the cell took it away."""
        if self.redis.poll() is not None:
            self.redis.start()


def _telemetry(url: str) -> dict[str, Any]:
    status, body = request(url + "/telemetry")
    assert status == 200, body
    return json.loads(body)


def joined(guards: list[GuardThread], count: int, timeout: float = 15.0) -> None:
    """Until every guard's link is up, it sees ``count`` guards, and it has telemetry from engine e0."""
    for guard in guards:
        wait_for(lambda g=guard: g.call(lambda: (g.state.shared.up, g.state.shared.live_guards)),
                 lambda seen: seen == (True, count), timeout)
        wait_for(lambda g=guard: g.call(lambda: g.state.pool.any_usable()), bool, 5)


# -- load -------------------------------------------------------------------------------------------------
async def _one(session: aiohttp.ClientSession, url: str, key: str, row: Row, max_tokens: int) -> None:
    body = {"model": "tiny", "prompt": "x" * 20, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    try:
        async with session.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                                timeout=aiohttp.ClientTimeout(total=CLIENT_DEADLINE_S)) as answer:
            payload = await answer.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        _count(row, "lost", type(exc).__name__)
        return
    if answer.status == 200 and payload.endswith(b"data: [DONE]\n\n"):
        row.ok += 1
    elif answer.status == 200 and b"event: error\ndata: " in payload.rsplit(b"\n\n", 2)[-2]:
        _count(row, "refused", "stream error event")
    elif answer.status != 200 and "error" in _json(payload):
        _count(row, "refused", f"{answer.status} {_json(payload)['error'].get('code')}")
    else:
        _count(row, "lost", f"{answer.status} unterminated")


def _json(payload: bytes) -> dict[str, Any]:
    with contextlib.suppress(ValueError):
        parsed = json.loads(payload)
        return parsed if isinstance(parsed, dict) else {}
    return {}


def _count(row: Row, outcome: str, kind: str) -> None:
    setattr(row, outcome, getattr(row, outcome) + 1)
    row.errors[f"{outcome}: {kind}"] = row.errors.get(f"{outcome}: {kind}", 0) + 1


async def flood(url: str, key: str, until: float, row: Row, streams: int = STREAMS, max_tokens: int = 32,
                stop: threading.Event | None = None) -> None:
    """``streams`` clients sending streamed completions back to back until ``until`` (or ``stop``)."""
    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < until and not (stop and stop.is_set()):
            await _one(session, url, key, row, max_tokens)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        await asyncio.gather(*(client(session) for _ in range(streams)))


@contextlib.contextmanager
def watching(guards: list[GuardThread], fleet: Fleet, row: Row) -> Iterator[None]:
    """Sample the guards' reservations on each engine every 20 ms; ``row.over_budget`` keeps the worst excess
    over that engine's pool."""
    stop = threading.Event()

    def held(guard: GuardThread) -> dict[str, int]:
        return guard.call(lambda: {r.name: r.gate.reserved for r in guard.state.pool})

    def sample() -> None:
        while not stop.wait(0.02):
            totals: dict[str, int] = {}
            for guard in guards:
                with contextlib.suppress(Exception):  # a guard stopping
                    for name, blocks in held(guard).items():
                        totals[name] = totals.get(name, 0) + blocks
            row.over_budget = max([row.over_budget, *(total - NUM_BLOCKS for total in totals.values())])

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def settle(fleet: Fleet, guards: list[GuardThread], row: Row, timeout: float = 20.0) -> None:
    """The closing checks: every engine idle with every block back, every guard holding nothing."""
    try:  # asked directly, not through the relay: a black-holed engine's requests end too
        for engine in fleet.engines:
            wait_for(lambda e=engine: _telemetry(e.url), idle_and_free, timeout)
        row.blocks_back = True
    except AssertionError:
        row.blocks_back = False
    try:
        for guard in guards:
            wait_for(lambda g=guard: guard_holds_nothing(g), lambda held: held == ({}, 0), timeout)
        row.reservations_back = True
    except AssertionError:
        row.reservations_back = False
        row.errors["held after"] = str([guard_holds_nothing(g) for g in guards])  # type: ignore[assignment]


# -- the cells --------------------------------------------------------------------------------------------
Fault = Callable[[Fleet, Callable[[], None]], None]  # (the fleet, SIGKILL the first guard) -> None


@dataclass(frozen=True, slots=True)
class Cell:
    fault: Fault
    victim: bool = False  # the first guard is a process, which the fault may SIGKILL
    # The first guard floods alone with twice the streams (its tenant borrows every engine's whole budget
    # while Redis is up); the second guard's tenant arrives just after the fault.
    lopsided: bool = False


def run_cell(fleet: Fleet, name: str, cell: Cell, streams: int = STREAMS, one_engine: bool = False) -> Row:
    """Two guards (the first a process when ``cell.victim``) flooded by a and b with ``streams`` clients each
    (in front of e0 alone when ``one_engine``), the fault run from its own thread half a second in (a
    second, ``lopsided``); then Redis back, and the closing checks."""
    victim, fault_at = cell.victim, 1.0 if cell.lopsided else 0.5
    max_tokens = 64 if cell.lopsided else 32  # longer streams: the first guard's excess drains slower
    row = Row(name)
    before = fleet.preemptions()
    raws = [fleet.guard_config(f"{name}-{i}", [fleet.e0.url] if one_engine else None) for i in range(2)]
    killed = threading.Event()
    with contextlib.ExitStack() as stack:
        survivor = stack.enter_context(GuardThread(GuardConfig.model_validate(raws[1])))
        if victim:
            path = fleet.root / f"guard-{len(list(fleet.root.glob('guard-*.yaml')))}.yaml"
            path.write_text(yaml.safe_dump(raws[0]))
            process = stack.enter_context(GuardProcess(path, name="victim", log=path.with_suffix(".log")))
            first_url, threads = process.url, [survivor]
            kill = lambda: (killed.set(), process.kill())
        else:
            first = stack.enter_context(GuardThread(GuardConfig.model_validate(raws[0])))
            first_url, threads = first.url, [first, survivor]
            kill = lambda: None
        joined(threads, 2)
        until = time.monotonic() + fleet.seconds
        chaos = threading.Thread(target=lambda: (time.sleep(fault_at), cell.fault(fleet, kill)), daemon=True)

        async def load() -> None:
            victim_row = Row("victim")
            async def second() -> None:
                if cell.lopsided:
                    await asyncio.sleep(fault_at + 0.05)
                await flood(survivor.url, "sk-b", until, row, streams, max_tokens)

            first_streams = 2 * streams if cell.lopsided else streams
            await asyncio.gather(flood(first_url, "sk-a", until, victim_row if victim else row, first_streams,
                                       max_tokens, stop=killed), second())
            if victim:  # what was in flight at the killed guard died with it: cut, not lost
                row.ok += victim_row.ok
                row.refused += victim_row.refused
                row.cut += victim_row.lost

        with watching(threads, fleet, row):
            chaos.start()
            asyncio.run(load())
            chaos.join()
        fleet.redis_up()
        joined(threads, 1 if victim else 2, timeout=15.0)
        row.preemptions = fleet.preemptions() - before
        settle(fleet, threads, row)
    return row


def redis_killed(fleet: Fleet, kill: Callable[[], None]) -> None:
    fleet.redis.kill()
    time.sleep(fleet.seconds - 1.0)
    fleet.redis.start()  # empty: the guards write their holdings back


def redis_slow(fleet: Fleet, kill: Callable[[], None]) -> None:
    """Redis answers nothing for 1.5 s at a time, twice (``DEBUG SLEEP``): slower than any deadline."""
    client = redis_client.Redis.from_url(fleet.redis.url, socket_timeout=10)
    for _ in range(2):
        client.execute_command("DEBUG", "SLEEP", "1.5")
        time.sleep(0.2)
    client.close()


def redis_slow_back_to_back(fleet: Fleet, kill: Callable[[], None]) -> None:
    """Redis connected but unresponsive for the rest of the load: ``DEBUG SLEEP 3`` back to back (issue 42's
    report: each guard must keep to its conservative share; the engine must see no preemption)."""
    client = redis_client.Redis.from_url(fleet.redis.url, socket_timeout=10)
    deadline = time.monotonic() + fleet.seconds - 0.5
    while time.monotonic() < deadline:
        client.execute_command("DEBUG", "SLEEP", "3")
    client.close()


def redis_link_cut(fleet: Fleet, kill: Callable[[], None]) -> None:
    """The link between the guards and Redis goes down (silence, no reset) for most of the load, then back."""
    assert fleet.redis_netns is not None, "the fleet's Redis runs on loopback: no link to cut"
    fleet.redis_netns.cut()
    time.sleep(fleet.seconds - 1.0)
    fleet.redis_netns.mend()


def redis_flapping(fleet: Fleet, kill: Callable[[], None]) -> None:
    """Down, then back empty, every half second."""
    deadline = time.monotonic() + fleet.seconds - 1.0
    while time.monotonic() < deadline:
        fleet.redis.kill()
        time.sleep(0.5)
        fleet.redis.start()
        time.sleep(0.5)


def guard_killed_in_outage(fleet: Fleet, kill: Callable[[], None]) -> None:
    fleet.redis.kill()
    time.sleep(0.5)
    kill()
    time.sleep(1.0)
    fleet.redis.start()


def engine_restarted_in_outage(fleet: Fleet, kill: Callable[[], None]) -> None:
    fleet.redis.kill()
    fleet.e0.stop(signal.SIGKILL)
    fleet.e0.start()
    time.sleep(0.5)
    fleet.redis.start()


def engine_killed(fleet: Fleet, kill: Callable[[], None]) -> None:
    """e0 SIGKILLed under load (its requests move to e1, issue 42), then started again."""
    fleet.e0.stop(signal.SIGKILL)
    time.sleep(1.0)
    fleet.e0.start()


def engine_stopped(fleet: Fleet, kill: Callable[[], None]) -> None:
    """e0 SIGSTOPped for longer than the guards' silence deadline (its requests move to e1), then continued."""
    fleet.e0.send_signal(signal.SIGSTOP)
    time.sleep(4.0)
    fleet.e0.send_signal(signal.SIGCONT)


def engine_blackholed(fleet: Fleet, kill: Callable[[], None]) -> None:
    assert fleet.hole is not None
    fleet.hole.swallow()


CELLS = {
    "redis killed": Cell(redis_killed),
    "redis killed after one guard borrowed all": Cell(redis_killed, lopsided=True),
    "redis slow (DEBUG SLEEP)": Cell(redis_slow),
    "redis slow, back to back (DEBUG SLEEP 3)": Cell(redis_slow_back_to_back),
    "redis flapping": Cell(redis_flapping),
    "guard SIGKILLed in an outage": Cell(guard_killed_in_outage, victim=True),
    "engine restarted in an outage": Cell(engine_restarted_in_outage),
    "engine killed": Cell(engine_killed),
    "engine stopped (SIGSTOP, silent)": Cell(engine_stopped),
    "engine black-holed": Cell(engine_blackholed),  # last: the relay stays a black hole
}
