"""One step's grammar bitmask: which tokens each constrained draw may take, filled before the step and
applied by the sampler.

Rows follow the step's draws (``SamplingBatch``'s order: each sampling sequence's own token, then one per
fork it spawns). Only the constrained rows are filled and applied; the others cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import xgrammar as xgr

from engine.sched.output import SchedulerOutput


@dataclass(slots=True)
class GrammarBitmask:
    bitmask: torch.Tensor  # [draws, ceil(vocab / 32)] int32 on the host: bit t of row r allows token t
    rows: list[int]  # the constrained draws: the rows that are filled

    @classmethod
    def for_step(cls, out: SchedulerOutput, vocab_size: int) -> GrammarBitmask | None:
        """The bitmask of ``out``'s draws from their completions' matchers (which have accepted every token
        committed so far); None when no draw is constrained."""
        constrained: list[tuple[int, xgr.GrammarMatcher]] = []
        row = 0
        for item in out.scheduled:
            seq = item.seq
            matchers = seq.request.matchers
            for index in range(seq.index, seq.index + item.num_samples):
                if matchers:
                    constrained.append((row, matchers[index]))
                row += 1
        if not constrained:
            return None
        bitmask = xgr.allocate_token_bitmask(row, vocab_size)
        for row, matcher in constrained:
            matcher.fill_next_token_bitmask(bitmask, row)
        return cls(bitmask, [row for row, _ in constrained])

    def apply(self, logits: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf, in place, in one call for all constrained rows."""
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=self.rows)
