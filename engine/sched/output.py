"""The scheduler's output: the one contract between scheduling and execution.

``Scheduler.schedule`` fills a ``SchedulerOutput``; the worker runs it from the plain data alone
(``chunks``, ``copies``, ``sampling``: token ids, positions, block ids, sampling parameters), without any
scheduler or KV-manager state; then ``Scheduler.advance`` and ``settle`` commit the step from ``scheduled``
and the tokens the worker sampled. ``scheduled`` and ``chunks`` are parallel lists in scheduling order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv.copies import BlockCopies
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch
    import xgrammar

    from engine.model.lora import LoraAdapter
    from engine.sched.request import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    """The scheduler's record of one sequence in the step, for committing it."""

    seq: Sequence
    num_new_tokens: int
    num_samples: int  # 0 for a prefill chunk that does not reach the end; else 1 + the forks it spawns


@dataclass(slots=True)
class ScheduledChunk:
    """What the worker computes for one sequence: the tokens at positions ``start .. start + len - 1``."""

    token_ids: list[int]
    start: int  # tokens of the sequence already in the KV cache
    # Device blocks holding positions 0 .. start + len(token_ids) - 1, in order: the KV manager's array('q')
    # (engine/kv/manager.py), or any sequence of ints.
    block_table: Sequence[int]
    sample: bool  # its last token's logits are wanted: a row of the step's logits
    lora: LoraAdapter | None = None  # the adapter its tokens run with; None: the base model
    # >= 0: its last token is ``PENDING``, sampled by the previous step and still on the device, in this row
    # of that step's tokens (the scheduler ran ahead, see ``Scheduler.advance``).
    pending_row: int = -1


@dataclass(slots=True)
class SamplingBatch:
    """The tokens to draw from the step's logits, in the order ``Scheduler.settle`` consumes them: each
    sampling sequence's own token, then one per fork it spawns, all drawn from that sequence's one row."""

    rows: list[int] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)
    generators: list[torch.Generator | None] = field(default_factory=list)
    num_rows: int = 0  # rows of logits: one per chunk with ``sample``

    def add(self, params: SamplingParams, generators: list[torch.Generator | None], first: int, count: int) -> None:
        """Draw ``count`` tokens from the next row, with ``generators[first : first + count]``."""
        row = self.num_rows
        self.num_rows += 1
        for index in range(first, first + count):
            self.rows.append(row)
            self.params.append(params)
            self.generators.append(generators[index])


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    copies: BlockCopies = field(default_factory=BlockCopies)
    sampling: SamplingBatch = field(default_factory=SamplingBatch)
    preempted: list[Sequence] = field(default_factory=list)
    # The sequence each sampled token goes to, in the order of ``sampling``: filled by ``Scheduler.advance``.
    targets: list[Sequence] = field(default_factory=list)

    @property
    def has_decode(self) -> bool:
        """Some sequence computes just its newest token and samples: the step yields an inter-token gap."""
        return any(s.num_new_tokens == 1 and s.num_samples for s in self.scheduled)

    def grammar_draws(self) -> tuple[int, list[tuple[int, xgrammar.GrammarMatcher]]]:
        """The step's draws in the order of ``sampling``: how many there are, and each one held to a grammar
        with its completion's matcher (``Request.matchers``), as (draw, matcher). A sequence's draws are its
        own token, then one per fork it spawns: completions ``seq.index`` onwards."""
        constrained: list[tuple[int, xgrammar.GrammarMatcher]] = []
        draw = 0
        for item in self.scheduled:
            seq = item.seq
            if matchers := seq.request.matchers:
                constrained += [(draw + k, matchers[seq.index + k]) for k in range(item.num_samples)]
            draw += item.num_samples
        return draw, constrained
