"""Everything one guard instance knows, shared by its handlers and background tasks (one event loop)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from guard.admission.dispatch import Dispatcher, Rejected
from guard.admission.gate import AdmissionGate
from guard.config import GuardConfig, Tenant
from guard.detect.detector import STATES, Detector
from guard.http.auth import KeyStore
from guard.http.relay import Relay
from guard.http.tokens import TokenCounter
from guard.metrics import MODES, GuardMetrics
from guard.pool.routing import CircuitBreaker, ModeMachine, Router
from guard.pool.telemetry import TelemetrySubscriber


@dataclass(slots=True)
class GuardState:
    config: GuardConfig
    keys: KeyStore
    gate: AdmissionGate
    dispatcher: Dispatcher
    metrics: GuardMetrics
    modes: ModeMachine
    router: Router
    breakers: dict[str, CircuitBreaker]
    detector: Detector
    fallback_models: dict[str, str] = field(default_factory=dict)  # engine fallback name -> its model name
    session: aiohttp.ClientSession | None = None
    relay: Relay | None = None
    counter: TokenCounter | None = None
    subscriber: TelemetrySubscriber | None = None
    tasks: tuple[asyncio.Task, ...] = ()
    in_flight: int = 0  # requests whose handler is running (shutdown waits for them)
    started_at: float = field(default_factory=time.monotonic)  # reset when the app starts serving
    # Set by the engine's first snapshot, or by the first failure to reach its telemetry stream.
    heard_from_engine: asyncio.Event = field(default_factory=asyncio.Event)
    total_weight: float = field(init=False)  # of all tenants (the configuration does not change at run time)

    def __post_init__(self) -> None:
        self.total_weight = sum(t.weight for t in self.config.tenants)

    @property
    def primary(self) -> CircuitBreaker:
        return self.breakers[self.config.engine.name]

    def start_left(self) -> float:
        """Seconds left of the start: neither a snapshot nor a failure yet, for at most ``telemetry_stale_s``.
        The guard has not had time to hear from its engine, which is not the same as an engine that went
        quiet. 0 once it has heard or the time is up."""
        if self.heard_from_engine.is_set():
            return 0.0
        return max(0.0, self.started_at + self.config.admission.telemetry_stale_s - time.monotonic())

    def primary_up(self) -> bool:
        """Its circuit is closed and its telemetry says it is alive: busy (in a long step) counts as up; silent,
        unhealthy or hung (a step past ``step_hang_s``) as down (see guard/admission/gate.py)."""
        return self.primary.closed and (self.gate.alive or self.start_left() > 0)

    async def wait_while_starting(self) -> None:
        """While starting, hold a request until the guard hears from its engine (or the start is over)."""
        if remaining := self.start_left():
            try:
                await asyncio.wait_for(self.heard_from_engine.wait(), remaining)
            except TimeoutError:
                pass  # still nothing: the caller finds no telemetry and treats the engine as unavailable

    def saturation(self) -> float:
        """Blocks committed plus blocks waiting in the guard's queues, over the pool (0 without telemetry)."""
        snapshot = self.gate.snapshot
        if snapshot is None or snapshot.num_blocks == 0:
            return 0.0
        return (self.gate.committed() + self.dispatcher.blocks_queued()) / snapshot.num_blocks

    def over_share(self, tenant: Tenant) -> bool:
        """Holding more than its weighted share of the admission budget."""
        return self.gate.tenant_reserved(tenant.name) > tenant.weight / self.total_weight * self.gate.budget

    def update_mode(self) -> None:
        change = self.modes.update(self.primary_up(), self.saturation())
        if change is not None:
            self.metrics.mode_transitions.labels(*change).inc()
            for mode in MODES:
                self.metrics.mode.labels(mode).set(1.0 if mode == change[1] else 0.0)

    def update_detector(self) -> None:
        """Re-score every tenant; apply the escalation of each state change (see guard/detect/detector.py)."""
        snapshot = self.gate.snapshot
        # The edge as the guard sees it: what is left uncommitted (engine blocks stay free under admission).
        free_share = 1.0 - self.gate.committed() / snapshot.num_blocks if snapshot and snapshot.num_blocks else 1.0
        waiting = {name for name, queue in self.dispatcher.fair.tenants.items() if len(queue)}
        for tenant, _, new in self.detector.evaluate(dict(self.gate.reserved_by_tenant), self.gate.budget, waiting,
                                                     free_share):
            self.metrics.detections.labels(tenant, new).inc()
            if new == "confirmed":  # what it had queued before is refused too, not only what comes next
                self.dispatcher.reject_queued(tenant, Rejected(429, ABUSE_CODE, ABUSE_MESSAGE, ABUSE_RETRY_AFTER_S))
            if new == "normal":
                self.dispatcher.block_caps.pop(tenant, None)
            else:
                self.dispatcher.block_caps[tenant] = SUSPECT_BLOCK_SHARE
        for name, signals in self.detector.tenants.items():
            self.metrics.suspicion.labels(name).set(signals.score)
            self.metrics.fs_state.labels(name).set(STATES.index(signals.state))


# Escalation for a suspect tenant: its reservations may use this share of the budget at most, its requests
# this many output tokens, and it is served after every configured lane.
SUSPECT_BLOCK_SHARE = 0.25
SUSPECT_MAX_TOKENS = 256
# A confirmed tenant's requests, queued or new, get 429 with this code and message.
ABUSE_CODE = "abuse_suspected"
ABUSE_MESSAGE = "requests from this key match a Fill-and-Squeeze attack pattern"
ABUSE_RETRY_AFTER_S = 60

STATE = web.AppKey("state", GuardState)
REQUEST_ID = web.RequestKey("request_id", str)
TENANT = web.RequestKey("tenant", str)
