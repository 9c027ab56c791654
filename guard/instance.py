"""Everything one guard instance knows, shared by its handlers and background tasks (one event loop).

``GuardState`` is built whole from the configuration (guard/server/app.py ``create_app``); what needs the
running loop (the HTTP client session and what uses it) is guard/http/clients.py's ``Clients``, built whole
when the app starts. Neither has a field that is filled in later. A reload (guard/server/reload.py) replaces ``config`` and ``keys``
together, in one step on the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from guard.admission.dispatch import Dispatcher
from guard.admission.limits import RateLimiter
from guard.admission.predictor import OutputPredictor
from guard.auth import KeyStore
from guard.config import GuardConfig, Tenant
from guard.detect.detector import Detector
from guard.detect.escalation import Escalation
from guard.events import EventLog
from guard.metrics import MODES, GuardMetrics
from guard.pool.pool import ReplicaPool
from guard.pool.routing import CircuitBreaker, ModeMachine, Router
from guard.pool.scheduling import Profiles
from guard.records.log import DecisionLog
from guard.records.store import RecordStore
from guard.state.limits import SharedRateLimiter
from guard.state.shared import SharedState


@dataclass(slots=True)
class GuardState:
    config: GuardConfig
    keys: KeyStore
    pool: ReplicaPool
    profile: Profiles  # the scheduling profiles, one chosen per request
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
    draining: bool = False  # told to stop (SIGTERM): /health answers 503 from then on, so load balancers move off
    limiter: RateLimiter = field(init=False)  # the tenants' rpm and tpm windows (RateLimiter.configure retakes them)
    events: EventLog = field(default_factory=EventLog)  # notable transitions, for the console (guard/console)
    shared: SharedState | None = None  # the link to the other guards' state (shared_state), if configured
    records: RecordStore = field(default_factory=RecordStore)  # the last requests' decision records
    decision_log: DecisionLog | None = None  # with decision_log: every record as a JSON line

    def __post_init__(self) -> None:
        self.limiter = (RateLimiter(self.config.tenants, self.metrics) if self.shared is None
                        else SharedRateLimiter(self.config.tenants, self.metrics, self.shared))
        self.metrics.ratelimit_levels.read = self.limiter.levels
        self.escalation.events = self.events  # detections join the one feed

    def saturation(self) -> float:
        """Blocks committed plus blocks waiting in the guard's queues, over the blocks of the replicas that
        are up (0 without telemetry). Borrowed blocks do not count: the pool takes them back on demand
        (guard/admission/dispatch.py), so a tenant that borrows the idle pool does not make it saturated."""
        return self._saturation(*self.pool.load()[1:])

    def _saturation(self, held: int, num_blocks: int) -> float:
        return 0.0 if num_blocks == 0 else (held + self.dispatcher.blocks_queued()) / num_blocks

    def over_share(self, tenant: Tenant) -> bool:
        """Holding more than its weighted share of the admission budget."""
        return self.pool.tenant_reserved(tenant.name) > self.dispatcher.guarantee(tenant)

    def update_mode(self) -> None:
        up, held, num_blocks = self.pool.load()
        saturation = self._saturation(held, num_blocks)
        change = self.modes.update(up, saturation)
        if change is not None:
            self.metrics.mode_transitions.labels(*change).inc()
            self.events.record("mode", was=change[0], now=change[1], saturation=round(saturation, 3))
            for mode in MODES:
                self.metrics.mode.labels(mode).set(1.0 if mode == change[1] else 0.0)

    def note_backends(self) -> None:
        """Feed each replica's going down or up, and each engine fallback's circuit opening or closing, to the
        event log. Polled (the health monitor calls it every round): a replica is up by its breaker and its
        telemetry together, which change in many places."""
        for replica in self.pool:
            self.events.track("replica", replica.name, "up" if replica.up() else "down", initial="up")
        for name, breaker in self.fallback_breakers.items():
            self.events.track("fallback", name, "closed" if breaker.closed else "open", initial="closed")


STATE = web.AppKey("state", GuardState)
