"""Where admission's decisions are made, as the one admission core (guard/admission/dispatch.py) sees it.

Alone, a guard decides in its process: the replicas' gates (guard/pool/gate.py) hold the reservations, the
fair queue (guard/admission/fairness.py) the counters, the limiter (guard/admission/limits.py) its windows,
the detector (guard/detect/) its verdicts. With shared state the same facts live in Redis, one atomic Lua
script per decision (guard/state/scripts.py), behind the small interfaces below; the dispatcher, the limits
and the verdicts are written once and call them. While Redis does not answer, each decides in the process
again, conservatively (guard/state/shared.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from guard.admission.fairness import FairQueue
from guard.admission.ticket import Ticket
from guard.pool.scheduling import Candidate

# What a shared reservation came to: "admitted"; "fair" (another tenant's turn across the guards); "full"
# (no replica had room); "down" (Redis did not answer: the gates decide alone).
Reserved = Literal["admitted", "fair", "full", "down"]


class Admitting(Protocol):
    """What a ledger follows of the dispatcher it serves."""

    fair: FairQueue[Ticket]

    def pump(self) -> None: ...


class Ledger(Protocol):
    """The reservations and VTC counters every guard shares (guard/state/ledger.py)."""

    @property
    def up(self) -> bool:
        """Whether decisions go through the ledger now (False: Redis is down, the gates decide)."""

    @property
    def stopping(self) -> bool: ...

    def attach(self, dispatcher: Admitting) -> None:
        """Follow ``dispatcher``: its backlog, what it holds (written back after an outage), its pump."""

    async def reserve(self, tenant: str, ticket: Ticket, ranked: Sequence[Candidate],
                      placed: Callable[[Candidate], None]) -> Reserved:
        """Reserve the ticket's blocks on the first of ``ranked`` with room, and charge its tenant's counter;
        ``placed`` is told the candidate the moment the ledger grants it (before anyone awaits the answer).
        Cancelled while the ledger decides, whatever it grants is given back."""

    def release(self, ticket: Ticket) -> None:
        """Give the admitted ticket's blocks back and settle its counter to what it generated."""
