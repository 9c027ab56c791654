"""One step's grammar bitmask: which tokens each constrained draw may take, filled before the step and
applied by the sampler.

Rows follow the step's draws (``SchedulerOutput.grammar_draws`` numbers them in the sampler's order). Only
the constrained rows are filled and applied; the others cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xgrammar as xgr


@dataclass(slots=True)
class GrammarBitmask:
    bitmask: torch.Tensor  # [draws, ceil(vocab / 32)] int32 on the host: bit t of row r allows token t
    rows: list[int]  # the constrained draws: the rows that are filled

    @classmethod
    def for_draws(cls, num_draws: int, constrained: list[tuple[int, xgr.GrammarMatcher]],
                  vocab_size: int) -> GrammarBitmask | None:
        """The bitmask of a step's ``num_draws`` draws, a row per draw, filled for each ``(draw, matcher)`` of
        ``constrained`` by its matcher (which has accepted every token committed so far); None when no draw is
        constrained."""
        if not constrained:
            return None
        bitmask = xgr.allocate_token_bitmask(num_draws, vocab_size)
        for row, matcher in constrained:
            matcher.fill_next_token_bitmask(bitmask, row)
        return cls(bitmask, [row for row, _ in constrained])

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf, in place, in one call for all constrained rows."""
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=self.rows)
