"""The reliability tests' counted client and the check each of them ends with: nothing was lost.

``ready_guard`` starts a guard that has seen its engine; ``Tally`` counts what a test sends and what comes
back; ``Client.call`` makes one counted request and returns the whole answer (a truncated body raises, so
it can never be counted as answered). ``assert_nothing_lost``:

- requests in = responses out: every request came back whole (a status and its entire body; for a stream,
  through ``[DONE]`` or an ``error`` event) or was abandoned by the test on purpose, and the guard recorded
  exactly one outcome for each in ``guard_requests_total``;
- every upstream is idle again, every block free or cached (``free_blocks + cached_blocks == num_blocks``;
  the fake upstream counts its open streams the same way, so for it this also says that the guard closed
  every connection it opened);
- the guard holds no reservation and queues nothing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
from multidict import CIMultiDict

from guard.config import GuardConfig

from .guard_server import GuardThread
from .net import request
from .wait import until

ERROR_KEYS = {"message", "type", "param", "code"}


class Upstream(Protocol):
    def telemetry(self) -> dict[str, Any]: ...


@dataclass(slots=True)
class Tally:
    sent: int = 0
    answered: int = 0
    abandoned: int = 0  # requests the test walked away from on purpose (a client that leaves)


@dataclass(slots=True)
class Answer:
    status: int
    headers: CIMultiDict[str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[bytes]:
        """The SSE events, each without its blank-line terminator."""
        return [event for event in self.body.split(b"\n\n") if event]


@dataclass(slots=True)
class Client:
    """Counted requests to one guard with one API key (a connection of its own for each)."""

    url: str
    tally: Tally
    key: str = "sk-acme"

    async def call(self, body: dict[str, Any] | None = None, *, key: str | None = None, data: Any = None,
                   headers: dict[str, str] | None = None, path: str = "/v1/completions",
                   started: asyncio.Event | None = None) -> Answer:
        """One request, read to its end; ``started`` is set once the answer's headers have arrived (for a
        stream from the guard, that is with its first token)."""
        all_headers = {"Authorization": f"Bearer {key or self.key}", **(headers or {})}
        self.tally.sent += 1
        async with aiohttp.ClientSession() as session, \
                session.post(self.url + path, json=body, data=data, headers=all_headers) as response:
            if started is not None:
                started.set()
            payload = await response.read()
        self.tally.answered += 1
        return Answer(response.status, CIMultiDict(response.headers), payload)


def assert_openai_error(answer: Answer, status: int, code: str | None = None, **expected: Any) -> dict[str, Any]:
    """``answer`` is the OpenAI error shape with ``status`` (and ``Retry-After`` in 1..60 for 429 and 503)."""
    assert answer.status == status, (answer.status, answer.body[:300])
    assert answer.headers["Content-Type"].startswith("application/json"), answer.headers
    assert answer.headers["X-Request-Id"].startswith("req-")
    body = answer.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), error
    if code is not None:
        assert error["code"] == code, error
    for key, value in expected.items():
        assert error[key] == value, error
    if status in (429, 503):
        assert 1 <= int(answer.headers["Retry-After"]) <= 60, answer.headers
    return error


def assert_stream_failed(answer: Answer) -> dict[str, Any]:
    """A stream that started (200) and then failed: its last event is an ``error`` event, and no ``[DONE]``."""
    assert answer.status == 200 and answer.headers["Content-Type"].startswith("text/event-stream"), answer
    events = answer.events()
    assert b"data: [DONE]" not in events, events[-3:]
    assert events[-1].startswith(b"event: error\ndata: "), events[-3:]
    body = json.loads(events[-1].split(b"data: ", 1)[1])
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    return body["error"]


def guard_outcomes(guard_url: str) -> float:
    """Requests the guard has finished, whatever their outcome (the sum of ``guard_requests_total``)."""
    _, body = request(guard_url + "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.decode().splitlines()
               if line.startswith("guard_requests_total{"))


@asynccontextmanager
async def ready_guard(config: GuardConfig, timeout: float = 5.0) -> AsyncIterator[GuardThread]:
    """A guard that has seen its engine (its first telemetry snapshot arrived), stopped on the way out."""
    with GuardThread(config) as guard:
        await until(lambda: guard.call(guard.state.pool.any_up), bool, timeout)
        yield guard


def idle_and_free(snapshot: dict[str, Any]) -> bool:
    busy = snapshot["num_running"] + snapshot["num_waiting"] + snapshot["num_swapped"]
    return busy == 0 and snapshot["free_blocks"] + snapshot["cached_blocks"] == snapshot["num_blocks"]


def guard_holds_nothing(guard: GuardThread) -> tuple[dict, int]:
    """The guard's reservations and the number of requests in its queues (read on its own loop)."""
    return guard.call(lambda: (dict(guard.state.pool.reservations()),
                               sum(len(q) for q in guard.state.dispatcher.fair.tenants.values())))


async def assert_nothing_lost(guard: GuardThread | None, tally: Tally, upstreams: Sequence[Upstream],
                              outcomes_before: float = 0.0, timeout: float = 5.0) -> None:
    """The closing check of every case (``guard`` is None for a guard that has exited)."""
    assert tally.sent == tally.answered + tally.abandoned, tally
    for upstream in upstreams:
        await until(upstream.telemetry, idle_and_free, timeout)
    if guard is None:
        return
    # The guard records an outcome just after the client has read the end of its answer.
    outcomes = await until(lambda: guard_outcomes(guard.url) - outcomes_before, lambda n: n >= tally.sent, timeout)
    assert outcomes == tally.sent, f"the guard recorded {outcomes} outcomes for {tally.sent} requests"
    await until(lambda: guard_holds_nothing(guard), lambda held: held == ({}, 0), timeout)
