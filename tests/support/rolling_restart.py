"""A rolling restart under load (issue 42, "Drain"): the compose stack's shape as processes, every engine
and then every guard restarted in turn while clients stream and wait for unary answers through haproxy.

``start_stack`` runs Redis, tiny engine replicas (``--drain-timeout`` short, so that what is still running
when an engine is told to stop is handed back and resumed elsewhere), two guards sharing Redis (started with
``--drain-delay``: on SIGTERM their ``/health`` turns 503 and they keep serving until haproxy's health check
has taken them out) and haproxy on deploy/haproxy.cfg (tests/support/haproxy.py). ``Load`` is closed-loop
clients through haproxy, each asking its own greedy question again and again, every answer checked whole
(status 200; a stream through ``[DONE]`` with no error event) and its text against the same question asked
of an engine directly. ``restart_engine`` / ``restart_guard``: SIGTERM, the exit (its code), the same
process started again, and back in (seen up by every guard; counted in by haproxy).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .guard_server import guard_config
from .haproxy import HAProxy
from .net import free_port, request
from .processes import EngineProcess, GuardProcess, Processes
from .redis_server import RedisServer
from .wait import until

GUARDS = ("guard-a", "guard-b")  # deploy/haproxy.cfg's server names
DRAIN_DELAY_S = 5.0  # haproxy.cfg checks every 2 s and takes a guard out after 2 failures: within ~4 s
ENGINE_DRAIN_TIMEOUT_S = 2.0
UNARY_TOKENS = 24


@dataclass
class Stack:
    redis: RedisServer
    engines: list[EngineProcess]
    guards: dict[str, GuardProcess]  # by haproxy's server name
    lb: HAProxy


def start_stack(processes: Processes, root: Path, engines: int = 3) -> Stack:
    """Everything started, each process answering (``back_in`` waits for the guards to see the engines and
    for haproxy to count the guards in; ``rolling_restart`` begins with it)."""
    redis = processes.add(RedisServer(root))
    replicas = [processes.engine("--num-blocks", "512", "--drain-timeout", str(ENGINE_DRAIN_TIMEOUT_S),
                                 name=f"e{i}", wait=False) for i in range(engines)]
    for engine in replicas:
        engine.wait_ready()
    guards = {}
    for name in GUARDS:
        (root / name).mkdir(exist_ok=True)
        guard_config([engine.url for engine in replicas], root / name, shared_state={"redis_url": redis.url},
                     listen={"host": "127.0.0.1", "port": free_port()})
        guards[name] = processes.guard(root / name / "guard.yaml", "--drain-delay", str(DRAIN_DELAY_S),
                                       name=name, wait=False)
    for guard in guards.values():
        guard.wait_ready()
    lb = processes.add(HAProxy(root, {name: f"127.0.0.1:{guard.port}" for name, guard in guards.items()}))
    return Stack(redis, replicas, guards, lb)


def sees_all_up(guard: GuardProcess) -> bool:
    """The guard's /health says every replica is up (False while it does not answer 200)."""
    try:
        status, body = request(guard.url + "/health", timeout=5)
    except OSError:
        return False
    return status == 200 and all(replica["up"] for replica in json.loads(body)["replicas"].values())


async def back_in(stack: Stack, timeout: float = 60.0) -> None:
    """Until every guard sees every replica up and haproxy counts every guard in."""
    for name, guard in stack.guards.items():
        await until(lambda g=guard: sees_all_up(g), bool, timeout, interval=0.1,
                    message=lambda g=guard: f"{g.name} does not see every engine up:\n{g.log_tail()}")
        await until(lambda n=name: stack.lb.server_up(n), bool, timeout, interval=0.1,
                    message=lambda n=name: f"haproxy does not count {n} in:\n{stack.lb.log_tail()}")


async def restart_engine(stack: Stack, engine: EngineProcess) -> dict[str, Any]:
    """SIGTERM, its exit, started again, back in: the exit code and the seconds each part took."""
    signalled = time.monotonic()
    code = await asyncio.to_thread(engine.stop)
    exited = time.monotonic()
    await asyncio.to_thread(engine.start)
    await back_in(stack)
    return {"restarted": engine.name, "exit_code": code, "seconds_to_exit": round(exited - signalled, 2),
            "seconds_back": round(time.monotonic() - exited, 2)}


async def restart_guard(stack: Stack, name: str) -> dict[str, Any]:
    """SIGTERM, haproxy counting it out, its exit, started again, back in. ``out_before_exit``: haproxy took
    it out on its health check while it still listened (the drain worked; a closed port would also do it)."""
    guard = stack.guards[name]
    signalled = time.monotonic()
    guard.send_signal(signal.SIGTERM)
    await until(lambda: not stack.lb.server_up(name), bool, 30, interval=0.05)
    out = time.monotonic()
    listening = guard.poll() is None and request_ok(guard.url + "/health")
    code = await asyncio.to_thread(guard.wait, 60)
    exited = time.monotonic()
    await asyncio.to_thread(guard.start)
    await back_in(stack)
    return {"restarted": name, "exit_code": code, "out_before_exit": listening,
            "seconds_to_out": round(out - signalled, 2), "seconds_to_exit": round(exited - signalled, 2),
            "seconds_back": round(time.monotonic() - exited, 2)}


def request_ok(url: str) -> bool:
    """Something answered at ``url`` (any status): the port is still open."""
    try:
        request(url, timeout=5)
    except OSError:
        return False
    return True


def chat(i: int, stream: bool, stream_tokens: int) -> dict[str, Any]:
    return {"model": "tiny", "temperature": 0.0, "ignore_eos": True, "stream": stream,
            "max_tokens": stream_tokens if stream else UNARY_TOKENS,
            "messages": [{"role": "user", "content": f"rolling restart {i}"}]}


def answer_text(status: int, raw: bytes, stream: bool) -> str | None:
    """The answer's text, None unless it came back whole (200; a stream through [DONE], no error event)."""
    if status != 200:
        return None
    if not stream:
        return json.loads(raw)["choices"][0]["message"]["content"]
    if not raw.endswith(b"data: [DONE]\n\n") or b"\nevent: error\n" in b"\n" + raw:
        return None
    text = ""
    for event in raw.split(b"\n\n"):
        if event.startswith(b"data: {"):
            data = json.loads(event[6:])
            text += "".join((c.get("delta") or {}).get("content") or "" for c in data.get("choices", []))
    return text


@dataclass
class Load:
    """``streams`` + ``unary`` closed-loop clients against ``url``, each on a keep-alive session of its own,
    client ``i`` always asking question ``i``; ``expected[i]``: its uninterrupted greedy answer."""

    url: str
    expected: list[str]
    streams: int
    unary: int
    stream_tokens: int
    key: str = "sk-acme"
    sent: int = 0
    whole: int = 0
    equal: int = 0
    failures: list[str] = field(default_factory=list)  # what each failed request got instead
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.client(i, i < self.streams)) for i in range(self.streams + self.unary)]

    async def finish(self) -> dict[str, Any]:
        """Stop sending, wait for what is in flight: the counts."""
        self.stop.set()
        await asyncio.wait_for(asyncio.gather(*self.tasks), 120)
        return {"sent": self.sent, "complete": self.whole, "failed": len(self.failures),
                "texts_equal": self.equal, "failures": self.failures[:5]}

    async def client(self, i: int, stream: bool) -> None:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not self.stop.is_set():
                self.sent += 1
                try:
                    async with session.post(self.url + "/v1/chat/completions", json=chat(i, stream, self.stream_tokens),
                                            headers={"Authorization": f"Bearer {self.key}"}) as response:
                        status, raw = response.status, await response.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    self.failures.append(f"client {i}: {exc!r}")
                    continue
                text = answer_text(status, raw, stream)
                if text is None:
                    self.failures.append(f"client {i}: {status} {raw[-300:]!r}")
                    continue
                self.whole += 1
                self.equal += text == self.expected[i]


async def expected_answers(engine_url: str, count: int, streams: int, stream_tokens: int) -> list[str]:
    """Each client's question asked of an engine directly, nothing interrupted: the greedy answers."""
    async with aiohttp.ClientSession() as session:

        async def one(i: int) -> str:
            stream = i < streams
            async with session.post(engine_url + "/v1/chat/completions", json=chat(i, stream, stream_tokens)) as response:
                text = answer_text(response.status, await response.read(), stream)
            assert text is not None, f"the engine did not answer question {i} whole"
            return text

        return list(await asyncio.gather(*(one(i) for i in range(count))))


def migrations(guard: GuardProcess) -> dict[str, float]:
    """``guard_migrations_total`` by reason, of the guard process as it runs now."""
    _, raw = request(guard.url + "/metrics")
    return {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in raw.decode().splitlines() if line.startswith("guard_migrations_total{")}


async def rolling_restart(stack: Stack, engines: list[EngineProcess], guards: list[str], streams: int,
                          unary: int, stream_tokens: int = 48, warmup_s: float = 1.0) -> dict[str, Any]:
    """Load through haproxy; ``engines`` restarted in turn, then ``guards``; the load stopped once the last
    is back in. Streams of ``stream_tokens`` that outlast an engine's ``--drain-timeout`` are handed back
    and resumed elsewhere (moves ``drain``). The report: the load's counts, each restart's row, and the guards' moves by reason before
    their own restarts (a restarted guard's counters start again at 0)."""
    await back_in(stack)
    expected = await expected_answers(stack.engines[0].url, streams + unary, streams, stream_tokens)
    load = Load(stack.lb.url, expected, streams, unary, stream_tokens)
    load.start()
    await asyncio.sleep(warmup_s)
    steps = [await restart_engine(stack, engine) for engine in engines]
    moves: dict[str, float] = {}
    for guard in stack.guards.values():
        for reason, count in (await asyncio.to_thread(migrations, guard)).items():
            moves[reason] = moves.get(reason, 0) + count
    steps += [await restart_guard(stack, name) for name in guards]
    await asyncio.sleep(warmup_s)  # the restarted guards serve too
    return {**await load.finish(), "moves": {k: v for k, v in moves.items() if v}, "steps": steps}
