"""A request's decision record (guard/records/), built from its ``Exchange`` once it has ended (an
end-of-request hook of guard/http/pipeline.py): kept in the guard's record store for
``GET /requests/{id}``, and written to ``decision_log`` when one is configured.

Only names, numbers and the guard's own error codes go in: never the body, the prompt, an output or a key.
A refusal's message is kept except at validation, where a message may quote what the client sent.
"""

from __future__ import annotations

import time

from aiohttp import web

from guard.admission.ticket import Ticket
from guard.errors import GuardError
from guard.http.exchange import Exchange
from guard.records.record import pack


def keep_record(ex: Exchange, response: web.StreamResponse | None, refused: GuardError | None) -> None:
    kept = pack(record_values(ex, response, refused))  # kept packed: guard/records/record.py
    ex.state.records.put(ex.request_id, kept)
    if ex.state.decision_log is not None:
        ex.state.decision_log.add(kept)


def record_values(ex: Exchange, response: web.StreamResponse | None, refused: GuardError | None) -> tuple:
    """The record of however far the request got (each stage's result, if its stage returned), as ``pack``
    takes it: ``DecisionRecord``'s fields, in order."""
    caller, parsed, entry = getattr(ex, "caller", None), getattr(ex, "parsed", None), getattr(ex, "entry", None)
    tenant = caller.tenant if caller is not None else None
    ticket, observer = (entry.ticket, entry.observer) if entry is not None else (None, None)
    candidates, blocks, tokens, borrowed, growths, predicted_hit = (), None, None, None, 0, None
    slo, priority_class, objective = None, None, None
    if ticket is not None:
        candidates = [candidate.kept() for candidate in ticket.candidates]
        blocks, tokens, borrowed = ticket.blocks, ticket.max_tokens, ticket.borrowed
        priority_class, objective = ticket.priority_class, ticket.objective_name
        if ticket.replica is not None:
            predicted_hit = ticket.hit_blocks * ex.sizing.block_size
        if entry.growth is not None:
            growths = entry.growth.granted
        if ticket.objective is not None:
            slo = slo_record(ticket)
    limits = getattr(ex, "limits", None)
    completion, reported_hit = (observer.output_tokens, observer.cached_tokens) \
        if observer is not None and ex.upstream is not None else (None, None)
    shed = None
    if refused is not None:
        # ``Shed``'s fields, as a plain tuple (marshal takes no named tuple); a validation message may quote
        # what the client sent, so it is not kept
        shed = (ex.stage, refused.status, refused.code, None if ex.stage == "validate" else refused.message)
    return (ex.request_id, tenant.name if tenant is not None else None, tenant.lane if tenant is not None else None,
            parsed.model.model if parsed is not None else None, response.status if response is not None else None,
            ex.outcome.value, ex.backend, ex.arrived, time.monotonic(),
            observer.first_at if observer is not None else 0.0, ex.stage_codes, ex.stage_starts.tobytes(),
            candidates, blocks, tokens, borrowed, growths, predicted_hit, reported_hit,
            limits.prompt_tokens if limits is not None else None, completion, shed,
            # moved (guard/http/migrate.py): every replica it ran on, the last one's included
            tuple(ex.replicas) if len(ex.replicas) > 1 else (),
            time.time(), slo, priority_class, objective)


def slo_record(ticket: Ticket) -> dict:
    """The objective, the predictions (medians, and the p90s admission judges by: guard/admission/slo.py;
    a refusal's ``shed`` says the rest) and the verdicts."""
    assert ticket.objective is not None
    return {**ticket.objective.as_record(),
            "predicted_ttft_ms": _ms(ticket.predicted_ttft), "predicted_ttft_p90_ms": _ms(ticket.predicted_ttft_p90),
            # of it: arrival to admission (the guard's queue), admission to the first token (the replica)
            "predicted_queue_ms": _ms(ticket.predicted_queue), "predicted_engine_ms": _ms(ticket.predicted_engine),
            "predicted_tpot_ms": _ms(ticket.predicted_tpot), "predicted_tpot_p90_ms": _ms(ticket.predicted_tpot_p90),
            "observed_tpot_ms": _ms(ticket.observed_tpot),  # the stream's mean gap between tokens
            "late_in_queue": ticket.late,  # queued past being on time, it yielded to those still on time
            "met": ticket.verdicts}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 3)
