"""Latency objectives: what a request was promised, what it is predicted to get, and refusing it early.

A request's ``Objective`` is its lane's ``slo`` (guard/config.py), tightened (never loosened) by the
headers ``X-SLO-TTFT-Ms`` and ``X-SLO-TPOT-Ms``, with its lane's ``priority_class``.

Its TTFT is predicted when it reaches the dispatcher, as

    predicted TTFT = guard queue wait + the best usable replica's engine TTFT (guard/pool/latency.py)

where the queue wait is the blocks that will be admitted before it, past the pool's free budget, over the
pool's measured drain rate (as the lane-timeout check reads it): a critical request waits only for the
critical requests queued before it (they go first, guard/admission/dispatch.py), a standard one for those
and its own tenant's lanes before its own (VTC serves other tenants by their counters, not before it), a
sheddable one for everything queued. A sheddable request whose prediction passes its TTFT objective is
refused at once (``slo_unattainable``, with ``Retry-After`` from the predicted drain): waiting would only
make it late and hold blocks that requests that can still be on time need. Critical and standard requests
are never refused for their objective: they are served and counted (``guard_slo_requests_total``). Before
the pool has drained anything there is no rate to predict a wait from, and nothing is refused.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from guard.config import Lane
from guard.errors import GuardError, Outcome
from guard.pool.pool import ReplicaPool

HEADERS = {"ttft": "X-SLO-TTFT-Ms", "tpot": "X-SLO-TPOT-Ms"}
CRITICAL, STANDARD, SHEDDABLE = "critical", "standard", "sheddable"


@dataclass(slots=True, frozen=True)
class Objective:
    ttft_s: float | None
    tpot_s: float | None
    priority_class: str

    def as_record(self) -> dict:
        return {"ttft_ms": None if self.ttft_s is None else round(1e3 * self.ttft_s, 3),
                "tpot_ms": None if self.tpot_s is None else round(1e3 * self.tpot_s, 3),
                "priority_class": self.priority_class}


def objective_for(lane: Lane, headers: Mapping[str, str]) -> Objective | None:
    """The lane's objective tightened by the request's headers; None when neither sets one. A header that is
    not a positive number of milliseconds is a 400 naming it; one looser than the lane's is ignored."""
    slo = lane.slo
    ttft = slo.ttft_ms if slo is not None else None
    tpot = slo.tpot_ms if slo is not None else None
    ttft, tpot = _tighten(ttft, headers, "ttft"), _tighten(tpot, headers, "tpot")
    if ttft is None and tpot is None:
        return None
    return Objective(None if ttft is None else ttft / 1e3, None if tpot is None else tpot / 1e3,
                     lane.priority_class)


def _tighten(lane_ms: float | None, headers: Mapping[str, str], which: str) -> float | None:
    name = HEADERS[which]
    raw = headers.get(name)
    if raw is None:
        return lane_ms
    try:
        asked = float(raw)
    except ValueError:
        asked = math.nan
    if not math.isfinite(asked) or asked <= 0:
        raise GuardError(400, f"header {name}: expected a positive number of milliseconds, got {raw[:32]!r}",
                         param=name, code="invalid_slo_header", outcome=Outcome.REJECTED_INVALID)
    return asked if lane_ms is None else min(lane_ms, asked)


class Judged(Protocol):
    """What judging reads of a ticket (guard/admission/dispatch.py) and writes into it."""

    lane: Lane
    objective: Objective | None
    blocks: int
    prompt_tokens: int
    arrived: float
    predicted_ttft: float | None
    predicted_tpot: float | None


def predicted_ttft(pool: ReplicaPool, ticket: Judged, ahead: int) -> tuple[float, float | None]:
    """(predicted TTFT from the ticket's arrival, the queue wait in it; None when the pool has no drain
    rate yet), with ``ahead`` blocks queued to be admitted before it."""
    wait = pool.expected_wait(max(0, pool.committed() + ahead + ticket.blocks - pool.budget()))
    engine = min((r.latency.predict_ttft(ticket.prompt_tokens) for r in pool.replicas if r.usable()),
                 default=0.0)
    return time.monotonic() - ticket.arrived + (wait or 0.0) + engine, wait


def judge(pool: ReplicaPool, ticket: Judged, ahead: int) -> None:
    """Predict the ticket's TTFT and TPOT into it; refuse a sheddable one that would miss its TTFT
    objective. ``ahead``: the blocks queued to be admitted before it, by its class (see the module docstring)."""
    objective = ticket.objective
    assert objective is not None
    ticket.predicted_ttft, wait = predicted_ttft(pool, ticket, ahead)
    ticket.predicted_tpot = min((r.latency.predict_tpot() for r in pool.replicas if r.usable()), default=None)
    if objective.priority_class != SHEDDABLE or objective.ttft_s is None or wait is None:
        return
    if ticket.predicted_ttft > objective.ttft_s:
        raise GuardError(503, f"predicted time to first token {ticket.predicted_ttft:.2f} s exceeds this "
                         f"request's objective ({objective.ttft_s:g} s); the lane is sheddable",
                         code="slo_unattainable", retry_after=max(1, min(60, math.ceil(wait))),
                         outcome=Outcome.REJECTED_OVERLOAD)
