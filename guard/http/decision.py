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
from guard.records.record import DecisionRecord, Shed


def keep_record(ex: Exchange, response: web.StreamResponse | None, refused: GuardError | None) -> None:
    record = build_record(ex, response, refused)
    ex.state.records.put(record)
    if ex.state.decision_log is not None:
        ex.state.decision_log.add(record)


def build_record(ex: Exchange, response: web.StreamResponse | None, refused: GuardError | None) -> DecisionRecord:
    """The record of however far the request got (each stage's result, if its stage returned)."""
    caller, parsed, entry = getattr(ex, "caller", None), getattr(ex, "parsed", None), getattr(ex, "entry", None)
    tenant = caller.tenant if caller is not None else None
    ticket, observer = (entry.ticket, entry.observer) if entry is not None else (None, None)
    record = DecisionRecord(
        ex.request_id, tenant.name if tenant is not None else None, tenant.lane if tenant is not None else None,
        parsed.model.model if parsed is not None else None, response.status if response is not None else None,
        ex.outcome.value, ex.backend, ex.arrived, time.monotonic(), observer.first_at if observer is not None else 0.0,
        ex.stage_names, ex.stage_starts, ticket.candidates if ticket is not None else (),
        time=time.time())
    if ticket is not None:
        record.blocks, record.tokens, record.borrowed = ticket.blocks, ticket.max_tokens, ticket.borrowed
        record.priority_class, record.objective = ticket.priority_class, ticket.objective_name
        record.predicted_hit_tokens = ticket.hit_blocks * ex.sizing.block_size if ticket.replica is not None else None
        if entry.growth is not None:
            record.growths = entry.growth.granted
        if ticket.objective is not None:
            record.slo = slo_record(ticket)
    if (limits := getattr(ex, "limits", None)) is not None:
        record.prompt_tokens = limits.prompt_tokens
    if observer is not None and ex.upstream is not None:
        record.completion_tokens, record.reported_hit_tokens = observer.output_tokens, observer.cached_tokens
    if len(ex.replicas) > 1:  # moved (guard/http/migrate.py): every replica it ran on, the last one's included
        record.replicas = tuple(ex.replicas)
    if refused is not None:
        message = None if ex.stage == "validate" else refused.message
        record.shed = Shed(ex.stage, refused.status, refused.code, message)
    return record


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
            "met": ticket.verdicts}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 3)
