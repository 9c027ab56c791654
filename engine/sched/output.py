"""The scheduler's output: the one contract between scheduling and execution.

``Scheduler.schedule`` fills a ``SchedulerOutput``; the worker runs it from the plain data alone (the
chunks' columns, ``copies``, ``sampling``: token ids, positions, block ids, sampling parameters), without any
scheduler or KV-manager state; then ``Scheduler.advance`` and ``settle`` commit the step from ``seqs``,
``num_new_tokens`` and ``num_samples`` and the tokens the worker sampled.
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
        self.rows += [row] * count
        self.params += [params] * count
        self.generators += generators[first:first + count]

    def one_each(self, params: list[SamplingParams], generators: list[torch.Generator | None]) -> None:
        """On an empty batch: one draw from each of ``len(params)`` rows, row ``i`` with ``params[i]`` and
        ``generators[i]`` (a step of decodes: ``add`` for every row at once)."""
        self.rows, self.num_rows = list(range(len(params))), len(params)
        self.params, self.generators = params, generators


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan, one column per field: entry ``i`` of every list below is the ``i``-th sequence
    scheduled (parallel lists rather than a record per sequence: a decode step of a few hundred sequences
    builds none, and the worker takes whole columns as they are).

    Sequence ``seqs[i]`` computes its tokens at positions ``starts[i] .. starts[i] + num_new_tokens[i] - 1``,
    whose ids are the next ``num_new_tokens[i]`` entries of ``token_ids``."""

    seqs: list[Sequence] = field(default_factory=list)  # for the commit; the worker never reads it
    num_new_tokens: list[int] = field(default_factory=list)
    # 0 for a prefill chunk that does not reach the end; else 1 + the forks it spawns. > 0: the chunk's last
    # token's logits are wanted, a row of the step's logits.
    num_samples: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # tokens of the sequence already in the KV cache
    token_ids: list[int] = field(default_factory=list)  # every chunk's tokens, one chunk after another
    # Device blocks holding positions 0 .. start + num_new_tokens - 1, in order: the KV manager's array('q')
    # (engine/kv/manager.py), or any sequence of ints.
    block_tables: list[Sequence[int]] = field(default_factory=list)
    loras: list[LoraAdapter | None] = field(default_factory=list)  # the adapter a chunk runs with (None: base)
    # >= 0: the chunk's last token is ``PENDING``, sampled by the previous step and still on the device, in
    # this row of that step's tokens (the scheduler ran ahead, see ``Scheduler.advance``); else -1.
    pending_rows: list[int] = field(default_factory=list)
    copies: BlockCopies = field(default_factory=BlockCopies)
    sampling: SamplingBatch = field(default_factory=SamplingBatch)
    preempted: list[Sequence] = field(default_factory=list)
    # The sequence each sampled token goes to, in the order of ``sampling``: filled by ``Scheduler.advance``.
    targets: list[Sequence] = field(default_factory=list)

    @property
    def has_decode(self) -> bool:
        """Some sequence computes just its newest token and samples: the step yields an inter-token gap."""
        return any(new == 1 and samples for new, samples in zip(self.num_new_tokens, self.num_samples))

    def grammar_draws(self) -> tuple[int, list[tuple[int, xgrammar.GrammarMatcher]]]:
        """The step's draws in the order of ``sampling``: how many there are, and each one held to a grammar
        with its completion's matcher (``Request.matchers``), as (draw, matcher). A sequence's draws are its
        own token, then one per fork it spawns: completions ``seq.index`` onwards."""
        constrained: list[tuple[int, xgrammar.GrammarMatcher]] = []
        draw = 0
        for seq, samples in zip(self.seqs, self.num_samples):
            if matchers := seq.request.matchers:
                constrained += [(draw + k, matchers[seq.index + k]) for k in range(samples)]
            draw += samples
        return draw, constrained
