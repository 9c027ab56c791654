"""A real engine server for tests: ``EngineServer`` on a loopback port, run on its own event-loop thread.

Running the server on its own loop lets synchronous tests use the synchronous ``openai`` client and
``urllib`` while asynchronous tests use aiohttp, against the same server, with nothing faked.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine
from typing import Any, Self, TypeVar

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.server.app import EngineServer

T = TypeVar("T")


class ServerThread:
    def __init__(self, wait_ready: bool = True, **options: Any) -> None:
        self.wait_ready = wait_ready
        self.config = EngineConfig(**{"model": "tiny", "device": "cpu", **options})
        self.url = ""
        self._server: EngineServer | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-server-loop", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()

        async def start() -> str:
            self._server = EngineServer(self.config)
            url = await self._server.start()
            if self.wait_ready:
                await self._server.wait_ready()
            return url

        self.url = self.run(start())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self.run(self._server.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    @property
    def server(self) -> EngineServer:
        assert self._server is not None
        return self._server

    @property
    def core(self) -> EngineCore:
        """The engine core; only inspect it once the engine is idle (its thread then waits for commands)."""
        return self.server.engine.core

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def get(self, path: str) -> tuple[int, bytes]:
        return request(self.url + path)

    def telemetry(self) -> dict[str, Any]:
        status, body = self.get("/telemetry")
        assert status == 200, body
        return json.loads(body)

    def wait_idle(self, timeout: float = 5.0) -> dict[str, Any]:
        """The first snapshot with no request left in the engine."""
        return wait_for(self.telemetry, lambda s: s["num_running"] + s["num_waiting"] + s["num_swapped"] == 0,
                        timeout)


def request(url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """GET (or POST ``body``) and return status and body, errors included."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def wait_for(probe: Callable[[], T], done: Callable[[T], bool], timeout: float, interval: float = 0.02) -> T:
    """Call ``probe`` until ``done`` holds for its result; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"still not done after {timeout} s: {value}")
        time.sleep(interval)
