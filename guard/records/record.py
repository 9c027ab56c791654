"""One request's decision record as it is read (``unpack``), and the packed form it is kept in from the
request's end (built by guard/http/decision.py).

The fields are plain values taken from the request's ``Exchange``, the times as ``time.monotonic()`` readings:
stage timings, queue time and TTFT become milliseconds, and the candidates dicts, only in ``to_dict``, when
the record is read or logged.

**Kept packed.** The last 10,000 records are kept (guard/records/store.py). Kept as objects (~13 a record)
they cost a unary request ~4 % of its CPU: they outlived thousands of requests, so each was freed, and
walked by the collector, from memory long out of the cache. ``pack`` makes the record's fields one
``bytes`` of ``marshal`` (~280 bytes, ~1 us), which the store copies into a buffer of its own: no object
of the request but its id outlives it, and unary's gap against ``94ca4f6`` went from 1.037 to 1.026
(bench/guard_ab.py; the rest of a record's cost is the packing and the copy's cold memory). ``unpack``
makes the record again when it is read. ``pack`` takes the fields as a tuple, which guard/http/decision.py
builds from the exchange in one pass, so a record holds plain data only: strings, numbers, lists, tuples
and dicts of them.
"""

from __future__ import annotations

import marshal
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

# A replica as the request's ranking saw it: its name, the filter that held it back (None: none), scorer name ->
# its value (unweighted), and the weighted sum (from guard/pool/scheduling/plugin.py's ``Candidate``).
KeptCandidate = tuple[str, str | None, dict[str, float], float]


class Shed(NamedTuple):
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
    candidates: Sequence[KeptCandidate]
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
            "candidates": [{"replica": replica, "filtered_by": filtered_by,
                            "scores": {name: round(value, 4) for name, value in scores.items()},
                            "total": round(total, 4)} for replica, filtered_by, scores, total in self.candidates],
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


# Every stage's name, at the code a record keeps it by: one byte a stage, where its name took ~8 and a tenth
# of the packing (guard/http/stages.py registers each stage it declares).
STAGE_NAMES: list[str] = []


def stage_code(name: str) -> int:
    """``name``'s code in ``STAGE_NAMES``, registered if new."""
    if name not in STAGE_NAMES:
        if len(STAGE_NAMES) == 256:
            raise ValueError(f"stage {name!r}: 256 stage names already, the most a byte codes")
        STAGE_NAMES.append(name)
    return STAGE_NAMES.index(name)


def pack(values: tuple) -> bytes:
    """``values``: a record's fields in ``DecisionRecord``'s order, its stage names as their codes (bytes),
    its stage starts as the bytes of an ``array("d")`` and its refusal as a plain tuple (what ``marshal``
    takes; see "Kept packed")."""
    return marshal.dumps(values)


def values_of(record: DecisionRecord) -> tuple:
    """What ``pack`` takes for ``record`` (guard/http/decision.py builds it from the exchange directly)."""
    values = [getattr(record, f.name) for f in fields(DecisionRecord)]
    values[_STAGES] = bytes(map(stage_code, record.stage_names))
    values[_STARTS] = array("d", record.stage_starts).tobytes()
    values[_SHED] = None if record.shed is None else tuple(record.shed)
    return tuple(values)


def unpack(kept: bytes) -> DecisionRecord:
    """The record ``pack`` was given, its lists and tuples as ``marshal`` gives them back (bytes after the
    packed record are ignored)."""
    values = list(marshal.loads(kept))
    values[_STAGES] = [STAGE_NAMES[code] for code in values[_STAGES]]
    starts = array("d")
    starts.frombytes(values[_STARTS])
    values[_STARTS] = starts
    values[_SHED] = None if values[_SHED] is None else Shed(*values[_SHED])
    return DecisionRecord(*values)


_NAMES = [f.name for f in fields(DecisionRecord)]
_STAGES, _STARTS, _SHED = _NAMES.index("stage_names"), _NAMES.index("stage_starts"), _NAMES.index("shed")
