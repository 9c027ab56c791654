"""Where a request goes: the pool of engine replicas, a fallback, or nowhere, by the guard's mode.

Modes, from the pool's health (up while any replica is) and how saturated it is (``saturation`` = blocks
committed plus blocks queued in the guard, over the blocks of the replicas that are up)::

    normal --(saturation >= pressure_enter)--> pressure --(>= degraded_enter, or engine down)--> degraded
      ^                                           |                                                |
      +--(< pressure_exit, after min_dwell_s)-----+<--(< degraded_exit and engine up, after dwell)--+

Moving up is immediate (an engine that died must not be waited on); moving down waits ``min_dwell_s`` in
the current mode and needs the lower exit threshold, so the mode does not flap at a boundary.

- normal: everything goes to the pool (which replica: its scheduling profile, guard/pool/scheduling/).
- pressure: sheddable lanes and tenants holding more than their weighted share go to a fallback first.
- degraded: new requests go to the fallbacks in config order (an engine fallback while its breaker is
  closed, then a static message); lanes with ``on_degraded: reject`` get 503 instead.

Each backend's circuit breaker opens after ``failure_threshold`` consecutive upstream failures (5xx from
the engine itself, timeouts, a lost telemetry stream) or failed health checks, at once when a connection
is refused (nothing listens there: ``trip``), and closes on the first success after ``cooldown_s``. The
guard's own 429/503 answers are never failures.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from guard.config import Backend, Lane, Routing, StaticFallback

log = logging.getLogger("guard.pool.routing")


class CircuitBreaker:
    def __init__(self, name: str, failure_threshold: int, cooldown_s: float) -> None:
        self.name = name
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.failures = 0
        self.opened_at: float | None = None

    @property
    def closed(self) -> bool:
        return self.opened_at is None

    def allow(self) -> bool:
        """Closed, or open long enough that one trial request may test the backend (half-open)."""
        return self.opened_at is None or time.monotonic() - self.opened_at >= self.cooldown_s

    def record_success(self) -> None:
        if self.opened_at is not None:
            log.info("backend %s: circuit closed", self.name)
        self.failures = 0
        self.opened_at = None

    def trip(self) -> None:
        """Open now: the backend refused a connection, so it is not there, whatever its count of failures."""
        self.failures = max(self.failures, self.failure_threshold - 1)
        self.record_failure()

    def record_failure(self) -> None:
        self.failures += 1
        if self.failures >= self.failure_threshold:
            if self.opened_at is None:
                log.warning("backend %s: circuit opened after %d consecutive failures", self.name, self.failures)
            self.opened_at = time.monotonic()  # a failed trial restarts the cooldown


@dataclass(slots=True, frozen=True)
class Route:
    kind: str  # "pool" | "engine" (a fallback engine) | "static" | "reject"
    name: str  # the backend's name; for "reject", why: "lane" (on_degraded: reject) or "no_backend"
    backend: Backend | StaticFallback | None = None


class ModeMachine:
    def __init__(self, config: Routing) -> None:
        self.config = config
        self.mode = "normal"
        self.since = time.monotonic()

    def update(self, pool_up: bool, saturation: float) -> tuple[str, str] | None:
        """Move to the mode the signals call for; returns ``(from, to)`` when the mode changed."""
        cfg = self.config
        if not pool_up or saturation >= cfg.degraded_enter:
            wanted = "degraded"
        elif saturation >= cfg.pressure_enter:
            wanted = "pressure"
        else:
            wanted = "normal"
        order = ("normal", "pressure", "degraded")
        if order.index(wanted) < order.index(self.mode):
            dwelt = time.monotonic() - self.since >= cfg.min_dwell_s
            calm = saturation < (cfg.degraded_exit if self.mode == "degraded" else cfg.pressure_exit)
            if not (dwelt and calm and pool_up):
                return None
            if self.mode == "degraded" and saturation >= cfg.pressure_exit:
                wanted = "pressure"  # step down one mode at a time when still busy
        if wanted == self.mode:
            return None
        change = (self.mode, wanted)
        self.mode, self.since = wanted, time.monotonic()
        log.warning("guard mode %s -> %s (pool %s, saturation %.2f)", *change, "up" if pool_up else "down",
                    saturation)
        return change


class Router:
    def __init__(self, fallbacks: list[Backend | StaticFallback], breakers: dict[str, CircuitBreaker]) -> None:
        self.fallbacks = fallbacks
        self.breakers = breakers

    def route(self, mode: str, lane: Lane, over_share: bool, pool_up: bool) -> Route:
        if mode == "normal" or (mode == "pressure" and not (lane.sheddable or over_share)):
            return Route("pool", "pool")
        if mode == "degraded" and lane.on_degraded == "reject":
            return Route("reject", "lane")
        # With no usable fallback a saturated but live pool still beats a refusal: its queue has deadlines.
        return self.fallback() or (Route("pool", "pool") if pool_up else Route("reject", "no_backend"))

    def fallback(self) -> Route | None:
        """The first usable fallback in config order."""
        for backend in self.fallbacks:
            if isinstance(backend, StaticFallback):
                return Route("static", backend.name, backend)
            if self.breakers[backend.name].allow():
                return Route("engine", backend.name, backend)
        return None
