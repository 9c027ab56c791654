"""One request on its way through the pipeline (guard/http/pipeline.py): the ``Exchange`` every stage reads
and fills in, and the headers every answer carries.

Fields are filled in stage by stage and stay None until their stage has run; a stage may rely on the
fields of the stages before it. ``laps`` holds ``(stage, time.monotonic())`` as each stage begins, in
order: the decision record's stage timings come from it, so marking a stage costs one clock read, and a
refusal is charged to the stage that was running (``stage``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from guard import tracing
from guard.admission.limits import Charge
from guard.admission.sizing import Growth, Sizing
from guard.admission.ticket import Ticket
from guard.config import Lane, Tenant
from guard.errors import GuardError, Outcome
from guard.http.clients import Clients
from guard.http.tokens import TokenLimits
from guard.http.validate import ParsedRequest
from guard.instance import GuardState
from guard.wire.relay import StreamObserver
from guard.wire.stamp import REQUEST_ID, TENANT
from guard.wire.upstream import Answer


@dataclass(slots=True)
class Exchange:
    request: web.Request
    state: GuardState
    clients: Clients
    arrived: float
    tenant: Tenant | None = None  # once authenticated
    lane: Lane | None = None  # the tenant's, resolved with it (a reload may change the lanes meanwhile)
    parsed: ParsedRequest | None = None  # once validated
    limits: TokenLimits | None = None  # once its prompts are counted
    sizing: Sizing | None = None  # once its reservation is sized
    capped: bool = False  # a suspect's cap bounds its output (sent upstream as max_tokens)
    salt: str = ""  # the tenant's cache salt, once the request goes to an engine
    ticket: Ticket | None = None  # its place in the fair queue, then its reservation
    observer: StreamObserver | None = None  # reads the answer as it is relayed
    growth: Growth | None = None  # a stream without max_tokens: grows its reservation as it goes
    charge: Charge | None = None  # once charged to its tenant's rate limits (None: a tenant without any)
    outcome: Outcome = Outcome.CANCELLED  # until a stage knows better: a client that left ends here
    trace: tracing.GuardTrace | None = None  # only while tracing is on
    upstream: Answer | None = None  # the answer being relayed, once the engine sent headers
    backend: str | None = None  # the replica or fallback it was last sent to (X-Guard-Backend)
    revoked: GuardError | None = None  # why the guard took the request's blocks back, if it did
    laps: list[tuple[str, float]] = field(default_factory=list)

    @property
    def request_id(self) -> str:
        return self.request[REQUEST_ID]

    @property
    def stage(self) -> str:
        """The stage running now (the last one entered)."""
        return self.laps[-1][0] if self.laps else ""

    def enter(self, stage: str, now: float) -> None:
        """``stage`` begins at ``now`` (time.monotonic()); the one before it ends there."""
        self.laps.append((stage, now))

    def revoke(self, reason: GuardError) -> None:
        """The guard ends this admitted request (guard/admission/dispatch.py, ``revoke``): its upstream
        request is dropped, and the client is told ``reason``."""
        self.revoked = reason
        if self.upstream is not None:
            self.clients.relay.revoke(self.upstream, reason)

    def count_outcome(self) -> None:
        """The one place a request's outcome is counted."""
        metrics = self.state.metrics
        tenant, lane = (self.tenant.name, self.tenant.lane) if self.tenant is not None else ("unknown", "none")
        metrics.child(metrics.requests, tenant, lane, self.outcome).inc()


def stamp_headers(request: web.Request, route: str | None = None) -> dict[str, str]:
    """Headers a prepared (streaming) response must carry from the start: the middleware is too late."""
    headers = {"X-Request-Id": request[REQUEST_ID]}
    if TENANT in request:
        headers["X-Guard-Tenant"] = request[TENANT]
    if route is not None:
        headers["X-Guard-Route"] = route
    return headers
