"""A real engine server for tests: ``EngineServer`` on a loopback port, run on its own event-loop thread.

Running the server on its own loop lets synchronous tests use the synchronous ``openai`` client and
``urllib`` while asynchronous tests use aiohttp, against the same server, with nothing faked.
"""

from __future__ import annotations

import json
from typing import Any

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.server.app import EngineServer

from .loop_thread import LoopThread
from .net import request
from .wait import wait_for


class ServerThread(LoopThread):
    """``with ServerThread(num_blocks=..., ...) as server``: the tiny model on CPU unless ``options`` say
    otherwise; ``__enter__`` returns once the model has loaded (unless ``wait_ready=False``)."""

    def __init__(self, wait_ready: bool = True, **options: Any) -> None:
        self.wait_ready = wait_ready
        self.config = EngineConfig(**{"model": "tiny", "device": "cpu", **options})
        self.url = ""
        self._server: EngineServer | None = None
        super().__init__("test-server-loop")

    async def started(self) -> None:
        self._server = EngineServer(self.config)
        self.url = await self._server.start()
        if self.wait_ready:
            await self._server.wait_ready()

    async def stopping(self) -> None:
        if self._server is not None:
            await self._server.stop()

    @property
    def server(self) -> EngineServer:
        assert self._server is not None
        return self._server

    @property
    def core(self) -> EngineCore:
        """The engine core; only inspect it once the engine is idle (its thread then waits for commands)."""
        return self.server.engine.core

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
