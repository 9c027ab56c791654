"""Iteration-level scheduler: which sequences compute how many tokens in the next step, and the commit of
each step once it has run.

Each step has a token budget (``max_num_batched_tokens``) shared by decodes and prefill chunks:

1. Running sequences, highest priority first, each get ``min(uncomputed tokens, budget left)`` tokens
   (one for a decode, a chunk for a prefill still in progress). When the pool cannot give one of them a
   slot, the lowest-priority, newest running sequence is preempted (possibly the one asking), by swap
   when configured and the host swap space has room, else by recompute.
2. Only if nobody was preempted: swapped sequences come back, then waiting ones are admitted in priority
   order, starting from their longest cached prefix, while the budget, ``max_num_seqs`` and the pool allow.
   Admission stops at the first sequence that does not fit, so a large request is not starved by small
   ones behind it. A sequence of a LoRA adapter fits only while the running sequences use fewer than
   ``max_loras`` adapters or already use its own, so every step's adapters fit the device slots.

Invariant: every sequence is in exactly one of ``waiting``, ``running``, ``swapped`` or finished; only
running sequences hold device blocks, only swapped ones hold host blocks.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable
from operator import attrgetter

from engine.kv.manager import KVCacheManager
from engine.sched.output import SchedulerOutput
from engine.sched.request import PENDING, Request, SeqStatus, Sequence
from engine.sched.stats import SchedulerLoad, SchedulerStats, TenantLoad

# Called with each sequence right after a sampled token is appended to it: the finish reason, or None.
StopCheck = Callable[[Sequence, int], str | None]

_sort_key = attrgetter("sort_key")


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str,
        check_stop: StopCheck,
        max_loras: int = 1,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.check_stop = check_stop
        self.max_loras = max_loras
        self.stats = SchedulerStats()
        # Admitting into the very last blocks only to preempt at the next decode is thrashing; keep a margin
        # free whenever something is already running.
        self.watermark_blocks = max(1, kv.pool.num_blocks // 100)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self._seq_ids = itertools.count()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def add_request(self, request: Request) -> None:
        """Queue the request's first sequence; it forks the other ``n - 1`` when it samples."""
        seq = self._new_sequence(request, 0, list(request.prompt_token_ids), [])
        seq.forks_pending = request.params.n - 1
        self._enqueue(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:
            budget = self._resume_swapped(out, budget)
            if not self.swapped:
                self._admit_waiting(out, budget)
        self._lay_out(out)
        return out

    def advance(self, out: SchedulerOutput) -> None:
        """The part of a step's commit that needs none of its sampled tokens.

        Every scheduled sequence's computed tokens are recorded and the blocks they filled published to the
        prefix cache; a sequence sampling its first token forks its siblings (before any token is appended,
        because appending may finish the parent and free the blocks the children share); then every sampling
        sequence gets ``PENDING`` as its last token and ``pending_row``, the row of the step's tokens that
        will replace it. ``out.targets`` lists them in the order of ``out.sampling``. A sequence that ended
        since it was scheduled (an abort) only keeps its rows' places in ``out.targets``.

        After this, ``schedule`` can plan the next step while this one's tokens are still on the device: a
        decode's input is then its ``PENDING`` token, which the worker takes from this step's sampled tokens
        (``SchedulerOutput.pending_rows``).
        """
        targets = out.targets
        commit, block_size = self.kv.commit, self.kv.block_size
        for seq, num_new, num_samples in zip(out.seqs, out.num_new_tokens, out.num_samples):
            if seq.status is SeqStatus.FINISHED:
                targets += [seq] * num_samples
                continue
            seq.num_computed_tokens += num_new
            if num_new > 1 or seq.num_computed_tokens % block_size == 0:  # a decode fills a block only there
                commit(seq)
            if num_samples == 1:
                seq.token_ids.append(PENDING)
                seq.pending_row = len(targets)
                targets.append(seq)
            elif num_samples:  # forks copy the tokens computed so far: they come before the parent's PENDING
                first = len(targets)
                targets.append(seq)
                targets += [self._fork(seq, index) for index in range(1, num_samples)]
                seq.forks_pending = 0
                for row in range(first, len(targets)):
                    targets[row].token_ids.append(PENDING)
                    targets[row].pending_row = row

    def settle(self, out: SchedulerOutput, sampled: list[int]) -> list[Request]:
        """Finish a step's commit once its tokens are known (``sampled``, in the order of ``out.sampling``):
        each ``PENDING`` token is replaced and its sequence finished if ``check_stop`` says so, which frees
        its blocks at once. Sequences that ended since ``advance`` are skipped: their tokens are dropped.
        Returns the requests that received tokens, in order of first token."""
        touched: dict[str, Request] = {}
        now = time.monotonic()
        check_stop = self.check_stop
        tokens = 0
        per_tenant: dict[str, int] = {}
        finished = SeqStatus.FINISHED
        for seq, token in zip(out.targets, sampled, strict=True):
            if seq.status is finished:
                continue
            request = seq.request
            if request.first_token_time is None:
                request.first_token_time = now
                self.stats.on_first_token(request.tenant, len(request.prompt_token_ids))
            seq.token_ids[-1] = token
            seq.pending_row = -1
            tokens += 1
            if (tenant := request.tenant) is not None:
                per_tenant[tenant] = per_tenant.get(tenant, 0) + 1
            if (reason := check_stop(seq, token)) is not None:
                self.finish(seq, reason)
            touched[request.request_id] = request
        self.stats.generation_tokens += tokens
        for tenant, count in per_tenant.items():
            self.stats.tenant(tenant).generation_tokens += count
        return list(touched.values())

    def can_run_ahead(self) -> bool:
        """After ``advance``: whether the next step may be scheduled before this one's tokens are read back.

        Only a steady decode qualifies: every running sequence has exactly one token to compute, nothing
        waits or is swapped out (admission hashes prompts' blocks, and a ``PENDING`` token must never enter
        a hash), no request follows a grammar (its next mask needs this step's tokens accepted), and the pool
        has a free block for every running sequence, so that nobody can be preempted. A sequence that the
        unread tokens end then computes one token too many, which ``settle`` of that step drops.
        """
        running = self.running
        if self.waiting or self.swapped or not running or self.kv.pool.num_free < len(running):
            return False
        for seq in running:
            if seq.num_computed_tokens + 1 != len(seq.token_ids) or seq.request.matchers:
                return False
        return True

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` wherever it is and release everything it holds. Idempotent."""
        if seq.status is SeqStatus.FINISHED:
            return
        queue = {SeqStatus.WAITING: self.waiting, SeqStatus.RUNNING: self.running,
                 SeqStatus.SWAPPED: self.swapped}[seq.status]
        queue.remove(seq)
        self.kv.free(seq)
        if seq.pending_row >= 0:  # its step failed between advance and settle: the token was never drawn
            seq.token_ids.pop()
            seq.pending_row = -1
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason

    def load(self) -> SchedulerLoad:
        """Queue lengths, the tokens still to prefill per priority, and per tenant its running and queued sequences
        and the device blocks they hold."""
        tenants: dict[str, TenantLoad] = {}
        blocks: dict[str, set[int]] = {}
        prefill: dict[int, int] = {}
        for seq in self.running:
            if (name := seq.request.tenant) is not None:
                tenants.setdefault(name, TenantLoad()).running += 1
                blocks.setdefault(name, set()).update(self.kv.block_ids(seq))
            if (left := seq.num_uncomputed_tokens) > 1:  # a prefill in progress (a decode computes one)
                prefill[seq.request.priority] = prefill.get(seq.request.priority, 0) + left
        for seq in self.waiting:
            prefill[seq.request.priority] = prefill.get(seq.request.priority, 0) + seq.num_uncomputed_tokens
        for seq in self.waiting + self.swapped:
            if (name := seq.request.tenant) is not None:
                tenants.setdefault(name, TenantLoad()).waiting += 1
        for name, ids in blocks.items():
            tenants[name].blocks = len(ids)
        return SchedulerLoad(len(self.running), len(self.waiting), len(self.swapped), tenants, prefill)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        running = self.running
        running.sort(key=_sort_key)
        seqs, nums, copies, allocate = out.seqs, out.num_new_tokens, out.copies, self.kv.allocate
        # running[:end] stay running; a victim is the last of them not scheduled yet, and leaves (to ``end``)
        scheduled, end = 0, len(running)
        while scheduled < end and budget:
            seq = running[scheduled]
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            while not allocate(seq, num_new, copies):
                end -= 1
                self._preempt(running[end], out)
                if end == scheduled:  # it was the victim: nobody after it was left
                    break
            else:
                seqs.append(seq)
                nums.append(num_new)
                scheduled += 1
                budget -= num_new
        del running[end:]
        return budget

    def _resume_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._adapter_fits(seq) or not self.kv.can_swap_in(seq, num_new):
                break
            self.swapped.pop(0)
            before = len(out.copies.swap_in)
            self.kv.swap_in(seq, num_new, out.copies)
            self.stats.blocks_swapped["in"] += len(out.copies.swap_in) - before
            self._start(seq, num_new, out)
            budget -= num_new
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        admitted = 0
        for seq in self.waiting:
            if (budget == 0 or len(self.running) + 1 + seq.forks_pending > self.max_num_seqs
                    or not self._adapter_fits(seq)):
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
            seq.num_computed_tokens += num_cached
            self.stats.prefix_queries_tokens += seq.num_tokens
            self.stats.prefix_hits_tokens += num_cached
            if seq.num_preemptions == 0 and seq.index == 0:
                # A resumed request's sequence starts with output tokens: only its prompt counts here.
                seq.request.num_cached_tokens = min(num_cached, len(seq.request.prompt_token_ids))
            self._start(seq, num_new, out)
            budget -= num_new
            admitted += 1
        del self.waiting[:admitted]

    def _adapter_fits(self, seq: Sequence) -> bool:
        lora = seq.request.lora
        if lora is None:
            return True
        running = {s.request.lora for s in self.running} - {None}
        return lora in running or len(running) < self.max_loras

    def _start(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        out.seqs.append(seq)
        out.num_new_tokens.append(num_new)

    def _lay_out(self, out: SchedulerOutput) -> None:
        """Fill the worker's columns of the sequences scheduled (``out.seqs``, ``out.num_new_tokens``) and the
        draws, one pass per column once every decision is taken: a scheduled sequence's tokens and blocks are
        final when it is scheduled (nothing later in a step touches the blocks of a sequence already
        scheduled, or its computed tokens)."""
        seqs, nums = out.seqs, out.num_new_tokens
        starts = out.starts = [seq.num_computed_tokens for seq in seqs]
        samples = out.num_samples = [1 + seq.forks_pending if start + num == len(seq.token_ids) else 0
                                     for seq, start, num in zip(seqs, starts, nums)]
        if len(seqs) == sum(nums):  # one token each: decodes, most steps
            out.token_ids = [seq.token_ids[start] for seq, start in zip(seqs, starts)]
        else:
            for seq, start, num in zip(seqs, starts, nums):
                out.token_ids += seq.token_ids[start:start + num]
        out.block_tables = self.kv.block_ids_of(seqs)
        requests = [seq.request for seq in seqs]
        out.loras = [request.lora for request in requests]
        out.pending_rows = [seq.pending_row if sampled else -1 for seq, sampled in zip(seqs, samples)]
        sampling = out.sampling
        if samples.count(1) == len(samples):  # one draw a sequence (decodes): the columns at once
            sampling.one_each([request.params for request in requests],
                              [request.generators[seq.index] for seq, request in zip(seqs, requests)])
            return
        for seq, request, count in zip(seqs, requests, samples):
            if count:
                sampling.add(request.params, request.generators, seq.index, count)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if self.preemption_mode == "swap" and self.kv.can_swap_out(seq):
            before = len(out.copies.swap_out)
            self.kv.swap_out(seq, out.copies)
            self.stats.on_preemption(seq.request.tenant, "swap", len(out.copies.swap_out) - before)
            seq.status = SeqStatus.SWAPPED
            bisect.insort(self.swapped, seq, key=_sort_key)
        else:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            self.stats.on_preemption(seq.request.tenant, "recompute", 0)
            self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=_sort_key)

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        """Start completion ``index`` of ``parent``'s request as a running copy sharing its blocks."""
        child = self._new_sequence(parent.request, index, list(parent.token_ids), list(parent.block_hashes))
        child.num_computed_tokens = parent.num_computed_tokens
        self.kv.fork(parent, child)
        child.status = SeqStatus.RUNNING
        self.running.append(child)
        return child

    def _new_sequence(
        self, request: Request, index: int, token_ids: list[int], block_hashes: list[bytes]
    ) -> Sequence:
        seq = Sequence(next(self._seq_ids), request, index, token_ids, len(request.prompt_token_ids),
                       block_hashes=block_hashes)
        request.seqs.append(seq)
        return seq
