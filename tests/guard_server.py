"""A real guard for tests: ``GuardThread`` serves the guard app on a loopback port from its own event-loop
thread, so synchronous clients (the ``openai`` SDK) and the engine's own server thread can talk to it."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any, Self

import yaml
from aiohttp import web

from guard.config import GuardConfig
from guard.http.app import STATE, GuardState, create_app


def guard_config(engine_url: str, tmp_path: Path | None = None, **overrides: Any) -> GuardConfig:
    raw: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "engine": {"name": "primary", "url": engine_url},
        "secret": "test-secret",
        "tenants": [
            {"name": "acme", "api_keys": ["sk-acme"], "weight": 2, "lane": "interactive"},
            {"name": "globex", "api_keys": ["sk-globex"], "weight": 1, "lane": "interactive"},
            {"name": "bulk", "api_keys": ["sk-bulk"], "weight": 1, "lane": "batch", "max_queue": 256},
        ],
    }
    raw.update(overrides)
    if tmp_path is not None:  # also exercise the YAML path
        (tmp_path / "guard.yaml").write_text(yaml.safe_dump(raw))
    return GuardConfig.model_validate(raw)


class GuardThread:
    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-guard-loop", daemon=True)
        self._runner: web.AppRunner | None = None

    def __enter__(self) -> Self:
        self._thread.start()

        async def start() -> str:
            app = create_app(self.config)
            self._runner = web.AppRunner(app, handler_cancellation=True,
                                         shutdown_timeout=self.config.limits.shutdown_timeout)
            await self._runner.setup()
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            await site.start()
            port = self._runner.addresses[0][1]
            return f"http://127.0.0.1:{port}"

        self.url = self.run(start())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            self.run(self._runner.cleanup())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    @property
    def state(self) -> GuardState:
        assert self._runner is not None
        return self._runner.app[STATE]

    def run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def call(self, fn: Any) -> Any:
        """Run ``fn()`` on the guard's loop (its state is not thread-safe) and return the result."""

        async def wrapper() -> Any:
            return fn()

        return self.run(wrapper())
