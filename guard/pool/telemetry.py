"""Subscribes to the engine's ``/telemetry/stream`` and feeds every snapshot and busy heartbeat to the guard.

The stream (engine/server/app.py) carries snapshots (``data:`` lines), busy heartbeats
(``: busy {"step": N | null, "step_running_s": S}`` comments) while one step runs for long and no snapshot
can be had until it ends, ``: heartbeat`` comments while idle, and an ``error`` event when the engine stops.
The subscriber hands snapshots and busy heartbeats to its callbacks; what they mean for admission and for
the engine's liveness is the gate's rule (guard/admission/gate.py). Other comments and events of other
names are skipped.

The subscription reconnects forever with exponential backoff (reset by the first good event). While it is
down nothing arrives, the admission gate's copy ages, and stale telemetry counts as a full pool and a down
engine: losing sight of the engine closes admission instead of admitting blind. A stream that sends no byte
at all (not even a heartbeat) for ``stale_s`` is dropped as dead, whatever TCP thinks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp
from pydantic import ValidationError

from engine.protocol import StepProgress, TelemetrySnapshot

log = logging.getLogger("guard.pool.telemetry")


BUSY = b": busy "


class TelemetrySubscriber:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        engine_url: str,
        on_snapshot: Callable[[TelemetrySnapshot], None],
        on_busy: Callable[[StepProgress], None],
        on_failure: Callable[[], None],
        stale_s: float,
        min_backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
    ) -> None:
        self.session = session
        self.url = engine_url.rstrip("/") + "/telemetry/stream"
        self.on_snapshot = on_snapshot
        self.on_busy = on_busy
        self.on_failure = on_failure
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
                    event = ""  # the name of the event being read; "" for a plain data event
                    async for raw in response.content:
                        line = raw.rstrip(b"\r\n")
                        if not line:  # a blank line ends the event
                            event = ""
                        elif line.startswith(b"event:"):
                            event = line[6:].strip().decode()
                        elif line.startswith(b"data:"):
                            self._dispatch(event, line[5:])
                            backoff = self.min_backoff_s
                        elif line.startswith(BUSY):
                            self.on_busy(StepProgress.model_validate_json(line[len(BUSY):]))
                            backoff = self.min_backoff_s
            except (aiohttp.ClientError, TimeoutError, ValidationError, ValueError) as exc:
                log.warning("telemetry stream %s: %s; reconnecting in %.2f s", self.url, exc, backoff)
                self.on_failure()
            finally:
                self.connected = False
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    def _dispatch(self, event: str, data: bytes) -> None:
        if event == "":
            self.on_snapshot(TelemetrySnapshot.model_validate_json(data))
        elif event == "error":  # the engine is stopping: its data is an error body, not a snapshot
            raise ValueError(f"the engine ended the stream: {data.decode(errors='replace').strip()}")
