"""Iteration-level scheduler: which sequences compute how many tokens in the next step.

Each step has a token budget (``max_num_batched_tokens``) shared by decodes and prefill chunks:

1. Running sequences, highest priority first, each get ``min(uncomputed tokens, budget left)`` tokens
   (one for a decode, a chunk for a prefill still in progress). When the pool cannot give one of them a
   slot, the lowest-priority, newest running sequence is preempted (possibly the one asking), by swap
   when configured and the host swap space has room, else by recompute.
2. Only if nobody was preempted: swapped sequences come back, then waiting ones are admitted in priority
   order, starting from their longest cached prefix, while the budget, ``max_num_seqs`` and the pool allow.
   Admission stops at the first sequence that does not fit, so a large request is not starved by small
   ones behind it.

Invariant: every sequence is in exactly one of ``waiting``, ``running``, ``swapped`` or finished; only
running sequences hold device blocks, only swapped ones hold host blocks.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from engine.kv.manager import BlockCopies, KVCacheManager
from engine.sched.request import SeqStatus, Sequence
from engine.telemetry import EngineStats


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    num_samples: int  # 0 for a prefill chunk that does not reach the end; else 1 + the forks it spawns


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: BlockCopies = field(default_factory=BlockCopies)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        stats: EngineStats,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str,
    ) -> None:
        self.kv = kv
        self.stats = stats
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        # Admitting into the very last blocks only to preempt at the next decode is thrashing; keep a margin
        # free whenever something is already running.
        self.watermark_blocks = max(1, kv.pool.num_blocks // 100)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            budget = self._resume_swapped(out, budget)
            if not self.swapped:
                self._admit_waiting(out, budget)
        return out

    def advance(self, out: SchedulerOutput) -> None:
        """Record that the step's tokens were computed and publish newly filled blocks to the prefix cache."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.kv.commit(item.seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` as a running copy of ``parent`` sharing its blocks."""
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SeqStatus.RUNNING
        self.running.append(child)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` wherever it is and release everything it holds. Idempotent."""
        if seq.status is SeqStatus.FINISHED:
            return
        queue = {SeqStatus.WAITING: self.waiting, SeqStatus.RUNNING: self.running,
                 SeqStatus.SWAPPED: self.swapped}[seq.status]
        queue.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        self.running.sort(key=lambda s: s.sort_key)
        queue = deque(self.running)
        still_running: list[Sequence] = []
        while queue:
            seq = queue.popleft()
            if budget == 0:
                still_running.append(seq)
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.kv.allocate(seq, num_new, out.copies):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new, self._num_samples(seq, num_new)))
                still_running.append(seq)
                budget -= num_new
        self.running = still_running
        return budget

    def _resume_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.kv.can_swap_in(seq, num_new):
                break
            self.swapped.pop(0)
            before = len(out.copies.swap_in)
            self.kv.swap_in(seq, num_new, out.copies)
            self.stats.on_swap_in(len(out.copies.swap_in) - before)
            self._start(seq, num_new, out)
            budget -= num_new
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        admitted = 0
        for seq in self.waiting:
            if budget == 0 or len(self.running) + 1 + seq.forks_pending > self.max_num_seqs:
                break
            cached = self.kv.find_cached_prefix(seq) if seq.num_computed_tokens == 0 else []
            num_cached = len(cached) * self.kv.block_size
            num_new = min(seq.num_tokens - seq.num_computed_tokens - num_cached, budget)
            margin = self.watermark_blocks if self.running else 0
            needed = self.kv.blocks_needed(seq.num_computed_tokens + num_cached + num_new)
            if needed - len(cached) + margin > self.kv.pool.num_free or not self.kv.allocate(
                seq, num_new, out.copies, cached
            ):
                break
            self.stats.on_prefix_lookup(seq.num_tokens, num_cached)
            if seq.num_preemptions == 0 and seq.index == 0:
                seq.request.num_cached_tokens = num_cached
            self._start(seq, num_new, out)
            budget -= num_new
            admitted += 1
        del self.waiting[:admitted]

    def _start(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append(ScheduledSeq(seq, num_new, self._num_samples(seq, num_new)))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if self.preemption_mode == "swap" and self.kv.can_swap_out(seq):
            before = len(out.copies.swap_out)
            self.kv.swap_out(seq, out.copies)
            self.stats.on_preemption(seq, "swap", len(out.copies.swap_out) - before)
            seq.status = SeqStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=lambda s: s.sort_key)
        else:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            self.stats.on_preemption(seq, "recompute", 0)
            self.add(seq)

    @staticmethod
    def _num_samples(seq: Sequence, num_new: int) -> int:
        return 1 + seq.forks_pending if num_new == seq.num_uncomputed_tokens else 0
