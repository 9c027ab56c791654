"""Everything one guard instance knows, shared by its handlers and background tasks (one event loop).

``GuardState`` is built whole from the configuration (guard/http/app.py ``create_app``); what needs the
running loop (the HTTP client session and what uses it) is ``Clients``, built whole when the app starts.
Neither has a field that is filled in later. A reload (guard/reload.py) replaces ``config`` and ``keys``
together, in one step on the loop.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from guard.admission.dispatch import Dispatcher
from guard.admission.limits import RateLimiter
from guard.admission.predictor import OutputPredictor
from guard.config import GuardConfig, Tenant
from guard.detect.detector import Detector
from guard.detect.escalation import Escalation
from guard.http.auth import KeyStore
from guard.http.relay import Relay
from guard.http.tokens import TokenCounter
from guard.metrics import MODES, GuardMetrics
from guard.pool.picker import Picker
from guard.pool.pool import ReplicaPool
from guard.pool.routing import CircuitBreaker, ModeMachine, Router


@dataclass(slots=True)
class GuardState:
    config: GuardConfig
    keys: KeyStore
    pool: ReplicaPool
    picker: Picker
    dispatcher: Dispatcher
    metrics: GuardMetrics
    modes: ModeMachine
    router: Router
    fallback_breakers: dict[str, CircuitBreaker]  # engine fallbacks by name
    detector: Detector
    escalation: Escalation
    predictor: OutputPredictor = field(default_factory=OutputPredictor)  # outputs of requests without max_tokens
    fallback_models: dict[str, str] = field(default_factory=dict)  # engine fallback name -> its model name
    in_flight: int = 0  # requests whose handler is running (shutdown waits for them)
    limiter: RateLimiter = field(init=False)  # the tenants' rpm and tpm windows (RateLimiter.configure retakes them)

    def __post_init__(self) -> None:
        self.limiter = RateLimiter(self.config.tenants, self.metrics)
        self.metrics.ratelimit_levels.read = self.limiter.levels

    def saturation(self) -> float:
        """Blocks committed plus blocks waiting in the guard's queues, over the blocks of the replicas that
        are up (0 without telemetry)."""
        num_blocks = self.pool.num_blocks()
        if num_blocks == 0:
            return 0.0
        return (self.pool.committed() + self.dispatcher.blocks_queued()) / num_blocks

    @property
    def total_weight(self) -> float:
        """Of the running configuration's tenants (asked only outside normal mode: summed when asked)."""
        return sum(t.weight for t in self.config.tenants)

    def over_share(self, tenant: Tenant) -> bool:
        """Holding more than its weighted share of the admission budget."""
        return self.pool.tenant_reserved(tenant.name) > tenant.weight / self.total_weight * self.pool.budget()

    def update_mode(self) -> None:
        change = self.modes.update(self.pool.any_up(), self.saturation())
        if change is not None:
            self.metrics.mode_transitions.labels(*change).inc()
            for mode in MODES:
                self.metrics.mode.labels(mode).set(1.0 if mode == change[1] else 0.0)


@dataclass(slots=True)
class Clients:
    """The guard's side of its connections to the engines, alive from start-up to clean-up."""

    session: aiohttp.ClientSession
    relay: Relay
    counter: TokenCounter
    tasks: list[asyncio.Task] = field(default_factory=list)  # subscriptions and the health monitor


STATE = web.AppKey("state", GuardState)
CLIENTS = web.AppKey("clients", Clients)
REQUEST_ID = web.RequestKey("request_id", str)
TENANT = web.RequestKey("tenant", str)
