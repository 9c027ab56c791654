"""One request on its way through its stages (guard/http/pipeline.py): the ``Exchange`` every stage reads and
adds its result to, and the headers every answer carries.

What the request is from the start (its HTTP request, the guard's state and clients, its arrival, its id)
and what may never come to be (an upstream answer, a backend, a revocation: None until they do) are fields
set at once. What only a stage makes is that stage's result, set by the runner (guard/http/stages.py) once
the stage has returned: ``caller`` (auth), ``parsed`` (validate), ``route`` (route), ``limits`` (count),
``sizing`` (size), ``entry`` (ticket), ``charge`` (limits). Those fields do not exist before: a stage
reads only what the stages before it made, and the end-of-request hooks, which run however far the
request got, ask with ``getattr(ex, field, None)``.

``stage_codes`` and ``stage_starts`` hold each stage's code (its name's, guard/records/record.py
``STAGE_NAMES``) and ``time.monotonic()`` as it begins, in order: the decision record's stage timings come
from them, and a refusal is charged to the stage that was running (``stage``). Two flat columns, not a list
of pairs: a lap is a clock read and two appends, and the record packs the columns as they are.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

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
from guard.pool.routing import Route
from guard.records.record import STAGE_NAMES
from guard.wire.relay import StreamObserver
from guard.wire.stamp import REQUEST_ID, TENANT
from guard.wire.upstream import Answer


class Caller(NamedTuple):
    """Who sent the request (the auth stage's result): its tenant, and the tenant's lane as configured when
    it arrived (a reload may change the lanes meanwhile)."""

    tenant: Tenant
    lane: Lane


@dataclass(slots=True)
class Entry:
    """The request in admission (the ticket stage's result): its ticket (a failover replaces it), the observer
    its answer is relayed through, the growth of a reservation without a bound of its own, and the tenant's
    cache salt."""

    ticket: Ticket
    observer: StreamObserver
    growth: Growth | None
    salt: str


@dataclass(slots=True)
class Exchange:
    request: web.Request
    state: GuardState
    clients: Clients
    arrived: float
    request_id: str  # the request's (guard/http/routes.py ``request_id_of``), as its record and logs name it
    outcome: Outcome = Outcome.CANCELLED  # until a stage knows better: a client that left ends here
    trace: tracing.GuardTrace | None = None  # only while tracing is on
    upstream: Answer | None = None  # the answer being relayed, once an engine sent headers
    backend: str | None = None  # the replica or fallback it was last sent to (X-Guard-Backend)
    revoked: GuardError | None = None  # why the guard took the request's blocks back, if it did
    replicas: list[str] = field(default_factory=list)  # every backend it was sent to, in order (migrations)
    stage_codes: bytearray = field(default_factory=bytearray)
    stage_starts: array[float] = field(default_factory=lambda: array("d"))
    # The stages' results (see the module): no default, set by the runner as each stage returns.
    caller: Caller = field(init=False)
    parsed: ParsedRequest = field(init=False)
    route: Route = field(init=False)
    limits: TokenLimits = field(init=False)
    sizing: Sizing = field(init=False)
    entry: Entry = field(init=False)
    charge: Charge | None = field(init=False)  # None: a tenant without rate limits

    @property
    def stage(self) -> str:
        """The stage running now (the last one entered)."""
        return STAGE_NAMES[self.stage_codes[-1]] if self.stage_codes else ""

    def revoke(self, reason: GuardError) -> None:
        """The guard ends this admitted request (guard/admission/dispatch.py, ``revoke``): its upstream
        request is dropped, and the client is told ``reason``."""
        self.revoked = reason
        if self.upstream is not None:
            self.clients.relay.revoke(self.upstream, reason)


def stamp_headers(request: web.Request, route: str | None = None) -> dict[str, str]:
    """Headers a prepared (streaming) response must carry from the start: the middleware is too late."""
    headers = {"X-Request-Id": request[REQUEST_ID]}
    if TENANT in request:
        headers["X-Guard-Tenant"] = request[TENANT]
    if route is not None:
        headers["X-Guard-Route"] = route
    return headers
