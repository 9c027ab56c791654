"""Scorers: each a value in [0, 1], higher is better, weighed by the profile (guard/pool/scheduling/plugin.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from guard.pool.scheduling.plugin import Context, register_scorer

if TYPE_CHECKING:
    from guard.pool.replica import Replica


@register_scorer("prefix")
class Prefix:
    """Cached leading prompt blocks on the replica over the prompt's full blocks: prefill saved. Exact, not
    guessed: each replica's prefix index follows the engine's own KV-cache events."""

    reads_prefix = True

    def score(self, replica: Replica, ctx: Context) -> float:
        return ctx.hits[replica] / ctx.prompt_blocks if ctx.prompt_blocks else 0.0


@register_scorer("free_blocks")
class FreeBlocks:
    """The share of the replica's budget left after this reservation: room."""

    reads_prefix = False

    def score(self, replica: Replica, ctx: Context) -> float:
        return ctx.free[replica]


@register_scorer("adapter")
class Adapter:
    """Where the request's LoRA adapter is: 1 on a replica that has it resident on the device, ``LOAD_COST``
    (``load_cost``) less on one that serves it but must first load it into a slot (evicting another), 0 on one that does
    not serve it (the engine there would answer 404). Every replica scores 1 for the base model."""

    reads_prefix = False
    LOAD_COST = 0.5

    def __init__(self, load_cost: float = LOAD_COST) -> None:
        if not 0 <= load_cost <= 1:
            raise ValueError(f"load_cost must be in [0, 1], got {load_cost!r}")
        self.load_cost = load_cost

    def score(self, replica: Replica, ctx: Context) -> float:
        snapshot = replica.gate.snapshot
        if ctx.lora is None:
            return 1.0
        if snapshot is None or ctx.lora not in snapshot.loras_available:
            return 0.0
        return 1.0 if ctx.lora in snapshot.loras else 1.0 - self.load_cost


@register_scorer("idle")
class Idle:
    """1 - the guard's requests in flight on the replica over the most on any candidate: queue and decode."""

    reads_prefix = False

    def score(self, replica: Replica, ctx: Context) -> float:
        return 1 - replica.in_flight / ctx.busiest
