"""The one in-process server helper: an event loop on its own daemon thread, and what runs on it.

A server run this way lives in the test's process, so a test can reach into it (``call(fn)`` runs ``fn`` on
the server's loop, where its state may be read safely) while synchronous clients (``urllib``, the ``openai``
SDK) and asynchronous ones (aiohttp, on the test's own loop) talk to it over loopback, with nothing faked.

``LoopThread`` is the loop and its thread; ``AppThread`` serves an aiohttp application from one on
``127.0.0.1``. The engine (``ServerThread``), the guard (``GuardThread``), the fake upstream and the live
stack's webhook receiver are each a few lines on top. Use them as context managers: the loop starts and the
server listens on ``__enter__``; the server stops and the thread ends on ``__exit__``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Self, TypeVar

from aiohttp import web

T = TypeVar("T")


class LoopThread:
    """An event loop on a daemon thread; a subclass starts its server in ``started``, stops it in
    ``stopping``."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)

    async def started(self) -> None:
        """Runs on the loop when the thread starts (start serving here)."""

    async def stopping(self) -> None:
        """Runs on the loop before the thread ends (stop serving here)."""

    def __enter__(self) -> Self:
        self._thread.start()
        try:
            self.run(self.started())
        except BaseException:
            with contextlib.suppress(Exception):  # stop what did start; the start's error is the one to see
                self.run(self.stopping())
            self._close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self.stopping())
        finally:
            self._close()

    def _close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run ``coro`` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn()`` on the loop (a server's state is not thread-safe) and return the result."""

        async def wrapper() -> T:
            return fn()

        return self.run(wrapper())


class AppThread(LoopThread):
    """An aiohttp application on ``127.0.0.1:port`` (0: any free port), served from a ``LoopThread`` by a
    ``runner_class`` (the guard's has its own, which guards its client connections)."""

    runner_class: type[web.AppRunner] = web.AppRunner

    def __init__(self, name: str, port: int = 0, **runner_options: Any) -> None:
        super().__init__(name)
        self.port = port
        self.url = ""
        self.runner_options = runner_options
        self.runner: web.AppRunner | None = None
        self.site: web.TCPSite | None = None

    def make_app(self) -> web.Application:
        raise NotImplementedError

    async def started(self) -> None:
        self.runner = self.runner_class(self.make_app(), **self.runner_options)
        await self.runner.setup()
        await self.listen()

    async def stopping(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def listen(self) -> None:
        """Listen (again, after ``stop_listening``) on the same port."""
        assert self.runner is not None
        self.site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True)
        await self.site.start()
        self.port = self.site.port
        self.url = f"http://127.0.0.1:{self.port}"

    async def stop_listening(self) -> None:
        """Close the listening socket only: connections already open are the runner's, and stay."""
        assert self.site is not None
        await self.site.stop()

    @property
    def app(self) -> web.Application:
        assert self.runner is not None
        return self.runner.app
