"""One request's decision record, built once when the request ends (guard/http/pipeline.py).

The fields are plain values taken from the request's ``Exchange``; ``candidates`` are the scheduling
profile's ``Candidate`` objects as ranked, turned into dicts only by ``to_dict`` (when the record is read or
logged), so that building a record costs the hot path one object.
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
    queue_ms: float | None  # arrival to admission (None: never admitted to the pool)
    ttft_ms: float | None  # arrival to the first streamed token
    stages: Sequence[tuple[str, float]]  # (stage, ms) in the order they ran
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
    time: float = 0.0  # when it ended (Unix seconds)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id, "tenant": self.tenant, "lane": self.lane, "model": self.model,
            "status": self.status, "outcome": self.outcome, "replica": self.replica,
            "queue_ms": _ms(self.queue_ms), "ttft_ms": _ms(self.ttft_ms), "time": round(self.time, 3),
            "stages": [{"name": name, "ms": _ms(ms)} for name, ms in self.stages],
            "candidates": [candidate.as_record() for candidate in self.candidates],
            "reservation": {"blocks": self.blocks, "tokens": self.tokens, "borrowed": self.borrowed,
                            "growths": self.growths},
            "prefix": {"predicted_hit_tokens": self.predicted_hit_tokens,
                       "reported_hit_tokens": self.reported_hit_tokens},
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens},
            "shed": None if self.shed is None else {"stage": self.shed.stage, "status": self.shed.status,
                                                    "code": self.shed.code, "message": self.shed.message},
        }

    def summary(self) -> dict[str, Any]:
        """The fields a list of recent requests shows."""
        return {"request_id": self.request_id, "tenant": self.tenant, "lane": self.lane, "status": self.status,
                "outcome": self.outcome, "replica": self.replica, "ttft_ms": _ms(self.ttft_ms),
                "time": round(self.time, 3)}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
