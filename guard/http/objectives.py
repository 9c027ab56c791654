"""A request's latency objective on the HTTP side: read from its lane and headers, and judged at its end.

The objective itself, the prediction and early shedding are guard/admission/slo.py's. Here, once the request
has ended (an end-of-request hook of guard/http/pipeline.py), its verdicts are counted: ``guard_slo_requests_total{lane, priority_class,
objective, met}`` once per objective it has (``priority_class``: the request's, guard/admission/classes.py), with

- TTFT met when the first token reached the client within the objective of its arrival. A unary answer's
  first token is the whole answer, so its TTFT is its end-to-end time, as its client sees it;
- TPOT met when the mean gap between the stream's tokens was within the objective (a unary answer or a
  stream of one token has no gaps: no TPOT verdict);
- a refusal (``slo_unattainable``, overload, a queue timeout) or an upstream failure misses every objective
  of its request: the client got no answer in time. A request its client cancelled before the end gets no
  verdict: nobody waited for it.

The prediction is scored too (``guard_ttft_predicted_seconds``, and ``guard_ttft_prediction_error_seconds``,
the absolute error, for requests that got a first token), and each replica's latency model learns the TPOT
of every stream served there, objective or not (guard/pool/latency.py).
"""

from __future__ import annotations

import time

from guard.admission.classes import select
from guard.admission.slo import Objective, objective_for
from guard.config import Lane
from guard.errors import Outcome
from guard.http.exchange import Exchange


def resolve(ex: Exchange, lane: Lane) -> tuple[str, str | None, Objective | None]:
    """The request's class, named objective and latency objective: its lane's, or those its headers select
    among its tenant's (guard/admission/classes.py), tightened by its X-SLO-* headers (400 or 403 for what
    it may not ask)."""
    headers = ex.request.headers
    selected = select(ex.caller.tenant, lane, headers)
    return selected.priority_class, selected.objective, objective_for(lane, headers, selected)


def account(ex: Exchange) -> None:
    """Count the ended request's verdicts and score its prediction (an end-of-request hook; requests that
    got no ticket: nothing; without an objective: only its replica learns its stream's TPOT)."""
    entry = getattr(ex, "entry", None)
    if entry is None or ex.outcome is Outcome.CANCELLED:
        return
    ticket, observer = entry.ticket, entry.observer
    completed = ex.outcome is Outcome.COMPLETED and ex.upstream is not None
    tpot: float | None = None  # the stream's mean gap between tokens (None: no stream of two tokens or more)
    if completed and observer.events > 1:
        tpot = (observer.last_at - observer.first_at) / (observer.events - 1)
        if ticket.replica is not None:
            ticket.replica.latency.observe_tpot(tpot, ticket.sent)
    if (objective := ticket.objective) is None:
        return
    ticket.observed_tpot = tpot
    metrics, lane = ex.state.metrics, ticket.tenant.lane
    streamed = observer.events > 0
    ttft: float | None = None  # seconds from arrival to the client's first token (None: no answer)
    if completed:
        ttft = (observer.first_at if streamed else time.monotonic()) - ex.arrived
    verdicts: dict[str, bool] = {}
    if objective.ttft_s is not None:
        verdicts["ttft"] = ttft is not None and ttft <= objective.ttft_s
    if objective.tpot_s is not None:
        if tpot is not None:
            verdicts["tpot"] = tpot <= objective.tpot_s
        elif ttft is None:
            verdicts["tpot"] = False
    for which, met in verdicts.items():
        metrics.child(metrics.slo_requests, lane, ticket.priority_class, which, "true" if met else "false").inc()
    ticket.verdicts = verdicts
    if ticket.predicted_ttft is not None:
        metrics.child(metrics.ttft_predicted, lane).observe(ticket.predicted_ttft)
        if ttft is not None and streamed:
            metrics.child(metrics.ttft_prediction_error, lane).observe(abs(ticket.predicted_ttft - ttft))
