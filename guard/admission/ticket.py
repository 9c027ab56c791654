"""A request as admission knows it, from the fair queue to the end of its reservation.

Invariant: a ticket is in exactly one state: queued (in the fair queue, no reservation), admitted (a
reservation on exactly one replica, ``ticket.replica``, not queued) or done (neither).
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from guard.admission import slo
from guard.config import Lane, Tenant
from guard.errors import GuardError
from guard.pool.latency import Sent
from guard.pool.replica import Replica
from guard.pool.scheduling import Candidate


class TicketState(enum.Enum):
    NEW = "new"
    QUEUED = "queued"
    ADMITTED = "admitted"
    DONE = "done"


@dataclass(slots=True, eq=False)
class Ticket:
    request_id: str
    tenant: Tenant
    lane: Lane
    prompt_tokens: int
    max_tokens: int
    blocks: int
    # Each prompt's full-block hashes under the tenant's salt, when the profile reads prefix hits.
    hashes: list[list[bytes]] = field(default_factory=list)
    enqueued_at: float = 0.0
    state: TicketState = TicketState.NEW
    # Created only for a ticket that has to wait: most are admitted within submit and never need one.
    admitted: asyncio.Future[None] | None = None
    replica: Replica | None = None  # where the reservation is (was, once done)
    hit_blocks: int = 0  # leading prompt blocks the replica it went to caches, as its index predicted
    borrowed: int = 0  # of ``blocks``, those beyond the tenant's guaranteed share (see the module docstring)
    # Set by whoever runs the admitted request: ends it, with the reason its client is to be told.
    on_revoke: Callable[[GuardError], None] | None = None
    revoked: GuardError | None = None  # why the guard took its blocks back, once it did
    output_tokens: int = 0  # what it generated, once it ended
    candidates: Sequence[Candidate] = ()  # the ranking that admitted it, for its decision record
    arrived: float = 0.0  # time.monotonic() of the request's arrival at the guard
    objective: slo.Objective | None = None  # its latency objective (guard/admission/slo.py), if it has one
    lora: str | None = None  # the LoRA adapter it names (None: the base model); its hashes include it
    model: str = ""  # the model id its client asked for (a profile may be chosen by it)
    # Its predictions (guard/admission/slo.py), medians and p90s in seconds: at arrival for the best
    # replica, the engine's part and TPOT predicted again for the replica it is placed on when it is.
    predicted_ttft: float | None = None  # from arrival: predicted_queue + predicted_engine
    predicted_ttft_p90: float | None = None
    predicted_tpot: float | None = None  # seconds per output token
    predicted_tpot_p90: float | None = None
    predicted_wait: float | None = None  # of predicted_ttft, the queue wait before its correction
    corrected_wait: float | None = None  # and its median after it, as judged
    predicted_queue: float | None = None  # of predicted_ttft, arrival to admission (corrected)
    predicted_queue_p90: float | None = None
    predicted_engine: float | None = None  # of predicted_ttft, admission to the first token
    predicted_engine_p90: float | None = None
    wait_key: tuple[str, bool] | None = None  # the correction that applied to it (guard/admission/slo.py)
    verdicts: dict[str, bool] | None = None  # objective ("ttft", "tpot") -> met, once it ended
    observed_tpot: float | None = None  # its stream's mean gap between tokens, once it ended (None: no stream)
    admitted_at: float = 0.0  # time.monotonic() of its admission
    uncached: int = 0  # its prompt tokens the replica has to prefill, until its first token (latency model)
    work: int = 0  # prefill tokens ahead of it on its replica when admitted, its own included
    priority: int = 0  # the engine priority it runs at, once admitted
    # Its load band, the sequences running there and what was predicted for it there when admitted (None:
    # not predicted, so not learned from: guard/pool/latency.py, "What is learned from"); ``prefilling``
    # while its prompt counts in that replica's latency model.
    sent: Sent | None = None
    prefilling: bool = False
    # Its class (guard/admission/classes.py): what admission orders, lends and sheds it by ("": its lane's).
    priority_class: str = ""
    objective_name: str | None = None  # the tenant's named objective it selected (None: none)
    stream: bool = False  # its answer streams: its replica learns the stream's TPOT (guard/pool/latency.py)
    # Queued past the point where it could be on time (guard/admission/slo.py ``late``): it yields to those
    # of its class that still can. Set once, by the dispatcher, as it moves the ticket in its tenant's queue.
    late: bool = False

    def __post_init__(self) -> None:
        if not self.priority_class:
            self.priority_class = self.lane.priority_class

    @property
    def order(self) -> tuple[int, int, int]:
        """Its place inside its tenant's queue (lower first): its class (critical first), then whether it is
        ``late`` (behind those of its class still on time), then its lane's priority. A request's class may
        differ from its lane's, so the class goes first: the critical band (guard/admission/dispatch.py) sees
        a tenant's critical request before its standard ones. (Computed when asked: most tickets are admitted
        without queueing and never need it.)"""
        return slo.ORDER[self.priority_class], self.late, self.lane.priority
