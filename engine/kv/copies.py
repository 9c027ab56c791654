"""Block moves that the scheduler's decisions imply and the worker performs before a step's forward."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class BlockCopies:
    """Moves in the order the worker must run them: swap-outs first, because they read device blocks that
    this same step may already have handed to other sequences (by swap-in, copy-on-write or allocation)."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    copy_on_write: list[tuple[int, int]] = field(default_factory=list)  # (device src, device dst)
