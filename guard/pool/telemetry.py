"""Subscribes to the engine's ``/telemetry/stream`` and feeds every snapshot and busy heartbeat to the guard.

The stream (engine/server/app.py) carries snapshots (``data:`` lines), busy heartbeats
(``: busy {"step": N | null, "step_running_s": S}`` comments) while one step runs for long and no snapshot
can be had until it ends, ``: heartbeat`` comments while idle, and an ``error`` event when the engine stops.
The subscriber hands snapshots and busy heartbeats to its callbacks; what they mean for admission and for
the engine's liveness is the gate's rule (guard/pool/gate.py). Other comments and events of other
names are skipped.

The reconnecting, the backoff and the staleness limit are ``SSEStream``'s (guard/pool/sse_reader.py): while
the stream is down nothing arrives, the admission gate's copy ages, and stale telemetry counts as a full
pool and a down engine: losing sight of the engine closes admission instead of admitting blind. Every end
of the stream is reported to ``on_failure``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import aiohttp

from engine.protocol import StepProgress, TelemetrySnapshot
from guard.pool.sse_reader import SSEStream

log = logging.getLogger("guard.pool.telemetry")

BUSY = b"busy "


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
        self.on_snapshot = on_snapshot
        self.on_busy = on_busy
        self.stream = SSEStream(session, engine_url.rstrip("/") + "/telemetry/stream", stale_s, log,
                                min_backoff_s, max_backoff_s)
        self.on_failure = on_failure

    async def run(self) -> None:
        """Follow the stream forever (until cancelled)."""
        await self.stream.follow(self._on_field, self.on_failure)

    def _on_field(self, event: str | None, data: bytes) -> None:
        if event == "":
            self.on_snapshot(TelemetrySnapshot.model_validate_json(data))
        elif event is None and data.startswith(BUSY):
            self.on_busy(StepProgress.model_validate_json(data[len(BUSY):]))
        elif event == "error":  # the engine is stopping: its data is an error body, not a snapshot
            raise ValueError(f"the engine ended the stream: {data.decode(errors='replace').strip()}")
        # Other comments (heartbeats) only keep the stream alive; events of other names are not ours.
