"""What the guard does to a tenant in each Fill-and-Squeeze state (guard/detect/detector.py decides the
state): the one place where a verdict becomes a consequence.

- ``normal``: nothing.
- ``suspect``: its requests may generate ``SUSPECT_MAX_TOKENS`` at most and are served after every
  configured lane; its reservations may hold ``SUSPECT_BLOCK_SHARE`` of the budget at most.
- ``confirmed``: its requests, queued or new, get 429 ``abuse_suspected``, and those already running are
  ended with that error (a stream with its error event): what they reserved goes back to the pool at once,
  instead of when their long generations would have ended.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NoReturn

from guard.admission.dispatch import Dispatcher
from guard.config import Lane, Tenant
from guard.detect.detector import STATES, Detector
from guard.errors import GuardError
from guard.events import EventLog
from guard.metrics import GuardMetrics
from guard.pool.pool import ReplicaPool

SUSPECT_BLOCK_SHARE = 0.25
SUSPECT_MAX_TOKENS = 256
ABUSE_CODE = "abuse_suspected"
ABUSE_MESSAGE = "requests from this key match a Fill-and-Squeeze attack pattern"
ABUSE_RETRY_AFTER_S = 60


def after_every(lanes: dict[str, Lane]) -> int:
    """The priority of a lane served after every configured one: where a suspect's requests go."""
    return max(lane.priority for lane in lanes.values()) + 1


def abuse_refusal() -> GuardError:
    return GuardError(429, ABUSE_MESSAGE, code=ABUSE_CODE, retry_after=ABUSE_RETRY_AFTER_S)


class Escalation:
    def __init__(self, detector: Detector, dispatcher: Dispatcher, pool: ReplicaPool, metrics: GuardMetrics,
                 lanes: dict[str, Lane]) -> None:
        self.detector = detector
        self.dispatcher = dispatcher
        self.pool = pool
        self.metrics = metrics
        self.last_lane = after_every(lanes)
        self.events = EventLog()  # the console's feed of detections (GuardState gives it the guard's own)
        self._publish()

    def reconfigure(self, weights: dict[str, float], lanes: dict[str, Lane]) -> None:
        """Take a reloaded configuration (tenants' weights, lanes); a removed tenant's series go with it."""
        for name in set(self.detector.tenants) - set(weights):
            self.metrics.suspicion.remove(name)
            self.metrics.fs_state.remove(name)
        self.detector.reconfigure(weights)
        self.last_lane = after_every(lanes)
        self._publish()

    def confirmed(self, tenant: str) -> bool:
        return self.detector.state(tenant) == "confirmed"

    def refuse(self, tenant: Tenant, max_tokens: int) -> NoReturn:
        """The 429 of a confirmed tenant's request, refused before anything else is spent on it; the
        detector still sees it arrive (a confirmed tenant stays so while it keeps up the pattern)."""
        self.detector.on_request(tenant.name, max_tokens)
        raise abuse_refusal()

    def shape(self, tenant: Tenant, lane: Lane, max_tokens: int) -> tuple[int | None, Lane]:
        """A request as the tenant's state allows it: a cap on its output (None: none) and its lane; raises
        the 429 when confirmed. Called once per request, with the output it is to be reserved for."""
        self.detector.on_request(tenant.name, max_tokens)
        state = self.detector.state(tenant.name)
        if state == "confirmed":
            raise abuse_refusal()
        if state == "suspect":
            return SUSPECT_MAX_TOKENS, lane.model_copy(update={"priority": self.last_lane})
        return None, lane

    def evaluate(self) -> None:
        """Re-score every tenant and apply the consequences of each state change."""
        budget, num_blocks = self.pool.budget(), self.pool.num_blocks()
        # The edge as the guard sees it: what is left uncommitted (engine blocks stay free under admission).
        free_share = 1.0 - self.pool.committed() / num_blocks if num_blocks else 1.0
        waiting = {name for name, queue in self.dispatcher.fair.tenants.items() if len(queue)}
        for tenant, _, new in self.detector.evaluate(self.pool.reserved_by_tenant(), budget, waiting, free_share):
            self._apply(tenant, new)
        self._publish()

    def adopt(self, confirmed: Iterable[str]) -> None:
        """Take the verdicts of other guards (guard/state/): these tenants stand confirmed there."""
        for tenant in confirmed:
            if self.detector.adopt(tenant):
                self._apply(tenant, "confirmed")
        self._publish()

    def _apply(self, tenant: str, new: str) -> None:
        """The consequences of the tenant's new state."""
        self.metrics.detections.labels(tenant, new).inc()
        self.events.record("detection", tenant=tenant, state=new)
        if new == "confirmed":  # what it had queued or running before ends too, not only what comes next
            self.dispatcher.reject_queued(tenant, abuse_refusal())
            self.dispatcher.revoke(tenant, abuse_refusal())
        if new == "normal":
            self.dispatcher.block_caps.pop(tenant, None)
        else:
            self.dispatcher.block_caps[tenant] = SUSPECT_BLOCK_SHARE

    def _publish(self) -> None:
        """Every tenant's score and state as metrics (a series for each from the start)."""
        for name, signals in self.detector.tenants.items():
            self.metrics.suspicion.labels(name).set(signals.score)
            self.metrics.fs_state.labels(name).set(STATES.index(signals.state))
