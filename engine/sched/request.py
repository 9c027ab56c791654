"""Request and sequence state shared by the scheduler and the output path (the worker sees neither).

A request owns ``n`` sequences. It starts as one sequence that computes the prompt; when the prompt's last
token is computed, that sequence samples ``n`` tokens and forks ``n - 1`` siblings that share its prompt
blocks copy-on-write. From then on every sequence is scheduled, preempted and resumed on its own.

A sequence's KV covers ``token_ids[:num_computed_tokens]``. Every step computes some of the remaining
tokens; when none remain, the step's last logits give the next token. So a decode is just a one-token
chunk, and a sequence preempted by recompute simply starts again at ``num_computed_tokens = 0``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch
    import xgrammar

    from engine.model.lora import LoraAdapter
    from engine.prompting.detokenizer import IncrementalDetokenizer
    from engine.structured.spec import Grammar


# A sequence's last token while the step that sampled it has run but its tokens are not read back yet
# (``Scheduler.advance``); never a vocabulary id.
PENDING = -1


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens, capped by the model's context
    tenant: str | None = None
    cache_salt: str | None = None
    priority: int = 0  # lower runs first, as in vLLM
    stream: bool = False  # detokenize as tokens arrive, so a server can send text deltas
    grammar: Grammar | None = None  # what every completion must match (engine/structured); None: anything
    lora: LoraAdapter | None = None  # the adapter it runs with (held, so an unload cannot pull it); None: base
    # Resumed (engine/output_processor.py, ``replay``): output tokens an earlier replica generated, which the
    # first sequence starts with, and the part of their text that replica's stream had sent; outputs carry
    # only what comes after both.
    resume_token_ids: list[int] = field(default_factory=list)
    resume_text: str = ""
    arrival_time: float = field(default_factory=time.monotonic)
    # Completion index -> its own random stream (seeded ``seed + index``, None when greedy or unseeded), so
    # that a seeded completion draws the same tokens whatever else is in the batch. Set by ``EngineCore.add``.
    generators: list[torch.Generator | None] = field(default_factory=list)
    # Completion index -> its grammar matcher (empty without a grammar), set by ``EngineCore.add``. Each has
    # accepted exactly its completion's output tokens: the commit advances it with every token appended, and
    # preemption keeps the tokens (recompute computes them again, swap keeps their KV), so it never rewinds.
    matchers: list[xgrammar.GrammarMatcher] = field(default_factory=list)
    seqs: list[Sequence] = field(default_factory=list)
    first_token_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission

    @property
    def finished(self) -> bool:
        """All sequences ended. Siblings are forked in the step their parent samples its first token, so an
        unfinished parent always stands for the forks it has yet to spawn."""
        for seq in self.seqs:  # a loop, not all(genexpr): asked for every request in every step
            if seq.status is not SeqStatus.FINISHED:
                return False
        return True


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request: Request
    index: int  # position among the request's n completions
    token_ids: list[int]
    num_prompt_tokens: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    forks_pending: int = 0  # siblings to create when this sequence samples its first token
    block_hashes: list[bytes] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    # While the last token is ``PENDING``: its row among the tokens of the step that sampled it; else -1.
    pending_row: int = -1
    # Text state, kept by ``engine.output_processor``.
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""
    stopped_by_string: bool = False
    # Scheduling order: priority, then age; the largest key is preempted first. Fixed for the sequence's
    # life, so computed once: every step sorts the running sequences by it.
    sort_key: tuple[int, float, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.sort_key = (self.request.priority, self.request.arrival_time, self.seq_id)

    @property
    def cache_salt(self) -> str | None:
        return self.request.cache_salt

    @property
    def lora(self) -> str | None:
        return self.request.lora.name if self.request.lora is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
