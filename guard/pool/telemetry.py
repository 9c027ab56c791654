"""Subscribes to the engine's ``/telemetry/stream`` and feeds every snapshot to the guard.

The subscription reconnects forever with exponential backoff (reset by the first good snapshot). While it
is down no snapshot arrives, the admission gate's copy ages, and stale telemetry counts as a full pool:
losing sight of the engine closes admission instead of admitting blind.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
from pydantic import ValidationError

from engine.protocol import TelemetrySnapshot

log = logging.getLogger("guard.pool.telemetry")


class TelemetrySubscriber:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        engine_url: str,
        on_snapshot: Callable[[TelemetrySnapshot], None],
        on_failure: Callable[[], None],
        stale_s: float,
        min_backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
    ) -> None:
        self.session = session
        self.url = engine_url.rstrip("/") + "/telemetry/stream"
        self.on_snapshot = on_snapshot
        self.on_failure = on_failure
        # A stream that has sent nothing (not even a heartbeat) for this long is dead, whatever TCP thinks.
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=stale_s, sock_read=stale_s)
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.connected = False

    async def run(self) -> None:
        backoff = self.min_backoff_s
        while True:
            try:
                async with self.session.get(self.url, timeout=self.timeout) as response:
                    if response.status != 200:
                        raise aiohttp.ClientResponseError(response.request_info, (), status=response.status)
                    self.connected = True
                    async for line in response.content:
                        if line.startswith(b"event: error"):  # the engine is stopping: its data is no snapshot
                            raise ValueError(f"the engine ended the stream: {await response.content.readline()!r}")
                        if line.startswith(b"data:"):
                            self.on_snapshot(TelemetrySnapshot.model_validate_json(line[5:]))
                            backoff = self.min_backoff_s
            except (aiohttp.ClientError, TimeoutError, ValidationError, ValueError) as exc:
                log.warning("telemetry stream %s: %s; reconnecting in %.2f s", self.url, exc, backoff)
                self.on_failure()
            finally:
                self.connected = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)
