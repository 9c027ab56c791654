"""A real headless Chromium for tests of pages (the operator console), driven over the DevTools protocol with
aiohttp's websocket client: no browser-automation package needed.

``async with Chromium(root) as page``: Debian's ``chromium`` (``make system-tools`` installs it) in
``--headless=new`` mode with ``--no-sandbox`` (CI runs as root), its profile and log under ``root``, started
as a ``Process`` of the one process factory; ``page`` is its first tab. ``--dump-dom`` is no use for a page
that keeps a stream open (Chromium waits for the network to go idle, which never happens), so the tests ask
the live page what it shows instead: ``page.evaluate(js)``, ``page.wait_for(js)`` until it holds.
``page.errors`` collects the page's uncaught exceptions and console errors.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import shutil
import time
from pathlib import Path
from typing import Any

import aiohttp

from .processes import Process
from .wait import wait_for


class Page:
    """One tab, over its DevTools websocket."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.ids = itertools.count(1)
        self.errors: list[str] = []

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        """Call ``method`` and return its result; events arriving meanwhile are noted (errors) or dropped."""
        ident = next(self.ids)
        await self.ws.send_json({"id": ident, "method": method, "params": params})
        while True:
            message = json.loads(await self.ws.receive_str(timeout=30))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self._note(message)

    def _note(self, message: dict[str, Any]) -> None:
        params = message.get("params", {})
        if message.get("method") == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.errors.append(details.get("exception", {}).get("description") or details.get("text", ""))
        elif message.get("method") == "Runtime.consoleAPICalled" and params.get("type") == "error":
            values = (arg.get("value", arg.get("description")) for arg in params["args"])
            self.errors.append(" ".join(str(value) for value in values))

    async def navigate(self, url: str, width: int = 1400, height: int = 900) -> None:
        await self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                        mobile=False)
        await self.send("Page.navigate", url=url)

    async def evaluate(self, expression: str) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 10.0) -> Any:
        """Until ``expression`` is truthy in the page; returns its value."""
        deadline = time.monotonic() + timeout
        while not (value := await self.evaluate(expression)):
            if time.monotonic() > deadline:
                raise AssertionError(f"still false after {timeout} s in the page: {expression}")
            await asyncio.sleep(0.1)
        return value

    async def screenshot(self, path: Path) -> None:
        """The whole page, as long as it is, as a PNG."""
        height = await self.evaluate("document.documentElement.scrollHeight")
        width = await self.evaluate("document.documentElement.clientWidth")
        await self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                        mobile=False)
        shot = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))


class Chromium:
    def __init__(self, root: Path) -> None:
        binary = shutil.which("chromium")
        assert binary, "chromium is not installed (make system-tools installs it)"
        self.profile = root / "chromium-profile"
        command = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                   "--no-default-browser-check", "--disable-extensions", "--remote-debugging-port=0",
                   f"--user-data-dir={self.profile}", "about:blank"]
        self.process = Process("chromium", command, log=root / "chromium.log")
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Page:
        active = self.profile / "DevToolsActivePort"  # Chromium writes its port there once it listens
        active.unlink(missing_ok=True)  # a previous run's
        self.process.start()
        try:
            wait_for(lambda: (active.exists() and len(active.read_text().split()) == 2)
                     or self.process.poll() is not None, bool, 30, message=self.process.log_tail)
            assert self.process.poll() is None, self.process.log_tail()
            port = int(active.read_text().split()[0])
            self.session = aiohttp.ClientSession()
            async with self.session.get(f"http://127.0.0.1:{port}/json/list") as response:
                targets = await response.json()
            tab = next(t for t in targets if t["type"] == "page")
            page = Page(await self.session.ws_connect(tab["webSocketDebuggerUrl"], max_msg_size=0))
            await page.send("Runtime.enable")
            return page
        except BaseException:
            await self.__aexit__()
            raise

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()
        self.process.close()
