"""How much KV a request reserves, and how a stream that outgrows its reservation asks for more.

A request reserves ``batch_blocks_for(prompts, reserve, n)`` blocks (guard/pool/gate.py), where ``reserve``
is the output each sequence may need: the client's own ``max_tokens`` when it gave one, else what its
tenant's requests of its lane generate (guard/admission/predictor.py), never past ``bound``, the output
the context window leaves (or a suspect's cap). A prediction that would not fit any replica's budget is
halved until it does; a declared bound that does not fit is refused, since the client asked for it.

``Growth`` follows an admitted stream: once its token events pass what the reservation covers, it asks the
dispatcher to double it (up to ``bound``); denied, it asks again a block later, when another request may
have ended. A request with a declared bound never grows: its reservation covers the bound from the start.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from guard.admission.dispatch import Dispatcher
from guard.admission.predictor import OutputPredictor
from guard.admission.ticket import Ticket
from guard.config import Lane, Tenant
from guard.errors import GuardError
from guard.pool.gate import batch_blocks_for

# The detector's verdict on a tenant for a request of so many output tokens: a cap on its output (None:
# none) and the lane it runs in (a suspect's is demoted); raises the 429 for a confirmed attacker
# (guard/detect/escalation.py ``Escalation.shape``).
Shape = Callable[[Tenant, Lane, int], tuple[int | None, Lane]]


@dataclass(slots=True, frozen=True)
class Sizing:
    """A request's reservation: ``reserve`` output tokens per sequence in ``blocks`` blocks."""

    block_size: int
    prompts: list[int]  # each prompt's tokens
    n: int  # sequences per prompt
    bound: int  # the output each sequence may generate (the client's bound, the window's room, or a cap)
    reserve: int  # the output each sequence's reservation covers (<= bound)
    blocks: int
    declared: bool  # the client gave max_tokens: the reservation covers it and never grows
    lane: Lane  # the lane it runs in, as the detector's verdict shaped it (size_request)
    capped: bool = False  # a suspect's cap bounds its output (sent upstream as max_tokens)

    @property
    def sequences(self) -> int:
        """Token streams of the request: a stream's token events are theirs, interleaved."""
        return len(self.prompts) * self.n

    def blocks_for(self, reserve: int) -> int:
        return batch_blocks_for(self.block_size, self.prompts, reserve, self.n)


def size_request(tenant: Tenant, lane: Lane, prompts: list[int], n: int, bound: int, max_tokens: int | None,
                 block_size: int, largest_budget: int, predictor: OutputPredictor, shape: Shape) -> Sizing:
    """A request's reservation: the client's bound (``max_tokens``), or without one what its tenant's
    requests of its lane generate (never past ``bound``, the room its context window leaves), shaped by
    the detector's verdict on the tenant (a suspect's output capped and its lane demoted)."""
    declared = max_tokens is not None
    reserve = bound if declared else predictor.predict(tenant.name, tenant.lane, bound)
    cap, lane = shape(tenant, lane, reserve)
    if cap is not None:
        bound, reserve = min(bound, cap), min(reserve, cap)
    return size_reservation(block_size, prompts, n, bound, reserve, declared, largest_budget, lane, cap is not None)


def size_reservation(block_size: int, prompts: list[int], n: int, bound: int, reserve: int, declared: bool,
                     largest_budget: int, lane: Lane, capped: bool = False) -> Sizing:
    """The reservation of ``reserve`` tokens per sequence, a prediction halved until it fits the largest
    replica budget. Raises ``GuardError`` (400) when even that cannot fit."""
    blocks = batch_blocks_for(block_size, prompts, reserve, n)
    while not declared and reserve > 1 and blocks > largest_budget:
        reserve //= 2
        blocks = batch_blocks_for(block_size, prompts, reserve, n)
    if blocks > largest_budget:
        raise GuardError(400, f"the request needs {blocks} KV blocks, more than the {largest_budget} the guard "
                         "can ever commit on one engine; lower max_tokens or shorten the prompt",
                         param="max_tokens")
    return Sizing(block_size, prompts, n, bound, reserve, blocks, declared, lane, capped)


class Growth:
    """Grows an admitted stream's reservation as its output passes what the reservation covers.

    ``ticket`` is the request's current ticket: the forwarding stage replaces it when it fails over to
    another replica. ``granted`` and ``denied`` count the requests made, for the decision record."""

    __slots__ = ("denied", "dispatcher", "granted", "grow_at", "sizing", "ticket")

    def __init__(self, sizing: Sizing, dispatcher: Dispatcher, ticket: Ticket) -> None:
        self.sizing = sizing
        self.dispatcher = dispatcher
        self.ticket = ticket
        self.grow_at = sizing.reserve * sizing.sequences  # token events past which more is needed
        self.granted = self.denied = 0

    def on_tokens(self, events: int) -> bool | None:
        """After a token event, ``events`` so far: None when nothing was asked, else whether the dispatcher
        granted more."""
        sizing, ticket = self.sizing, self.ticket
        if events < self.grow_at or ticket.max_tokens >= sizing.bound:
            return None
        wanted = min(sizing.bound, 2 * ticket.max_tokens)
        granted = self.dispatcher.grow(ticket, sizing.blocks_for(wanted), wanted)
        if granted:
            self.granted += 1
            self.grow_at = ticket.max_tokens * sizing.sequences
        else:
            self.denied += 1
            self.grow_at += sizing.block_size * sizing.sequences
        return granted
