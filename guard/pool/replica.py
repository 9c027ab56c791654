"""One engine replica as the guard sees it: its admission gate (telemetry, budget, reservations), its circuit
breaker, the exact index of the prefix blocks it caches, and the guard's requests running on it.

A replica is *up* while its circuit is closed and its telemetry says it is alive (a busy engine in a long
step counts as alive; see guard/pool/gate.py), or while it is still starting: for the first
``telemetry_stale_s`` the guard has not had time to hear from it, which is not the same as a replica that
went quiet.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from engine.protocol import TelemetrySnapshot
from guard.config import Backend
from guard.pool.gate import AdmissionGate
from guard.pool.latency import LatencyModel
from guard.pool.prefix_index import PrefixIndex
from guard.pool.routing import CircuitBreaker


@dataclass(slots=True, eq=False)
class Replica:
    backend: Backend
    gate: AdmissionGate
    breaker: CircuitBreaker
    index: PrefixIndex = field(default_factory=PrefixIndex)
    latency: LatencyModel = field(default_factory=LatencyModel)  # predicted TTFT and TPOT, learned online
    in_flight: int = 0  # the guard's requests admitted here and not finished: the picker's load signal
    last_admitted: float = 0.0  # when (monotonic) the guard last admitted a request here: the picker's tie-break
    started_at: float = field(default_factory=time.monotonic)  # reset when the guard starts serving
    # Set by the replica's first snapshot, or by the first failure to reach its telemetry stream.
    heard: asyncio.Event = field(default_factory=asyncio.Event)
    # The engine's prefix-cache counters at its previous snapshot, to turn totals into increments (None
    # before the first: what an engine did before this guard saw it is not this guard's to report).
    _hits_total: int | None = None
    _queries_total: int | None = None
    # The backend's, read on every request: attributes, not properties (a replica's backend never changes).
    name: str = field(init=False)
    url: str = field(init=False)  # without a trailing slash

    def __post_init__(self) -> None:
        self.name, self.url = self.backend.name, self.backend.url.rstrip("/")

    def admitted(self) -> None:
        """A request of the guard's was admitted here (``finished`` when it ends)."""
        self.in_flight += 1
        self.last_admitted = time.monotonic()

    def finished(self) -> None:
        self.in_flight -= 1

    def start_left(self) -> float:
        """Seconds left of the replica's start (0 once heard from, or once ``telemetry_stale_s`` is over)."""
        if self.heard.is_set():
            return 0.0
        return max(0.0, self.started_at + self.gate.config.telemetry_stale_s - time.monotonic())

    def up(self) -> bool:
        return self.breaker.opened_at is None and (self.gate.alive() or self.start_left() > 0)  # closed, as read

    def usable(self) -> bool:
        """Up with numbers that may be admitted against (see ``AdmissionGate.usable``)."""
        return self.breaker.opened_at is None and self.gate.usable()

    def on_snapshot(self, snapshot: TelemetrySnapshot) -> tuple[int, int]:
        """Take a snapshot; returns the engine-reported prefix-cache (hit, query) tokens since the last one
        (none for the first). Totals that went down mean the engine restarted: they count from zero again."""
        self.gate.update(snapshot)
        self.latency.on_snapshot(snapshot, self.in_flight)
        self.heard.set()
        hits, queries = snapshot.prefix_cache_hits_total, snapshot.prefix_cache_queries_total
        before_hits, before_queries = self._hits_total, self._queries_total
        self._hits_total, self._queries_total = hits, queries
        if before_hits is None or before_queries is None:
            return 0, 0
        return (hits - before_hits if hits >= before_hits else hits,
                queries - before_queries if queries >= before_queries else queries)
