"""One request's decision record, built once when the request ends (guard/http/pipeline.py).

The fields are plain values taken from the request's ``Exchange``, the times as ``time.monotonic()`` readings:
stage timings, queue time and TTFT, and the candidates (the scheduling profile's ``Candidate`` objects as
ranked) become milliseconds and dicts only in ``to_dict``, when the record is read or logged, so that
keeping a record costs the hot path one object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class Candidate(Protocol):
    def as_record(self) -> dict[str, Any]: ...


@dataclass(slots=True)
class Shed:
    """Why the guard itself answered with an error: the stage that refused, and its error."""

    stage: str
    status: int
    code: str | None
    message: str | None  # None for validation errors, whose messages may quote what the client sent


@dataclass(slots=True)
class DecisionRecord:
    request_id: str
    tenant: str | None
    lane: str | None
    model: str | None
    status: int | None  # the answer's HTTP status (None: the client left before one was sent)
    outcome: str  # guard_requests_total's outcome
    replica: str | None  # where it was served: a replica (X-Guard-Backend) or a fallback's name
    arrived: float  # time.monotonic() of its arrival
    ended: float  # and of its end
    first_token: float  # of its first streamed token (0.0: none)
    stage_names: Sequence[str]  # the stages in the order they ran
    stage_starts: Sequence[float]  # and when each began (time.monotonic())
    candidates: Sequence[Candidate]
    blocks: int | None = None
    tokens: int | None = None  # the output the reservation covers, per sequence, at its end
    borrowed: int | None = None
    growths: int = 0
    predicted_hit_tokens: int | None = None
    reported_hit_tokens: int | None = None  # the engine's usage.prompt_tokens_details.cached_tokens
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    shed: Shed | None = None
    replicas: Sequence[str] = ()  # every backend it ran on, in order, when it was moved (guard/http/migrate.py)
    time: float = 0.0  # when it ended (Unix seconds)
    # Its latency objective, what was predicted for it and the verdicts (guard/admission/slo.py); None: none.
    slo: dict[str, Any] | None = None
    # Its class and the tenant's named objective it selected (guard/admission/classes.py); None: not got that far.
    priority_class: str | None = None
    objective: str | None = None

    @property
    def queue_ms(self) -> float | None:
        """Arrival to admission to the pool (the forward stage's start); None when never admitted."""
        names = self.stage_names
        if "forward" not in names:
            return None
        return _ms(1e3 * (self.stage_starts[names.index("forward")] - self.arrived))

    @property
    def ttft_ms(self) -> float | None:
        """Arrival to the first streamed token; None for an answer that was not streamed."""
        return _ms(1e3 * (self.first_token - self.arrived)) if self.first_token else None

    def stages(self) -> list[dict[str, Any]]:
        starts = self.stage_starts
        ends = [*starts[1:], self.ended]
        return [{"name": name, "ms": _ms(1e3 * (end - began))}
                for name, began, end in zip(self.stage_names, starts, ends)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "tenant": self.tenant, "lane": self.lane, "model": self.model,
            "priority_class": self.priority_class, "objective": self.objective, "status": self.status, "outcome": self.outcome, "replica": self.replica,
            "replicas": list(self.replicas) or ([self.replica] if self.replica is not None else []),
            "queue_ms": self.queue_ms, "ttft_ms": self.ttft_ms, "time": round(self.time, 3),
            "stages": self.stages(),
            "candidates": [candidate.as_record() for candidate in self.candidates],
            "reservation": {"blocks": self.blocks, "tokens": self.tokens, "borrowed": self.borrowed,
                            "growths": self.growths},
            "prefix": {"predicted_hit_tokens": self.predicted_hit_tokens,
                       "reported_hit_tokens": self.reported_hit_tokens},
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens},
            "shed": None if self.shed is None else {"stage": self.shed.stage, "status": self.shed.status,
                                                    "code": self.shed.code, "message": self.shed.message},
            "slo": self.slo,
        }

    def summary(self) -> dict[str, Any]:
        """The fields a list of recent requests shows."""
        return {"request_id": self.request_id, "tenant": self.tenant, "lane": self.lane,
                "priority_class": self.priority_class, "objective": self.objective, "status": self.status,
                "outcome": self.outcome, "replica": self.replica, "ttft_ms": self.ttft_ms,
                "time": round(self.time, 3)}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
