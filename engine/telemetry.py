"""Engine counters kept per step (and per tenant), turned into ``TelemetrySnapshot`` on demand.

Counters only grow. Rates (tokens/s, bytes/s, step time, inter-token latency) are averaged over the steps
of the last ``RATE_WINDOW_S`` seconds, so a snapshot taken while idle decays to zero instead of freezing
at the last busy value.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.protocol import TelemetrySnapshot, TenantUsage

if TYPE_CHECKING:
    from engine.kv.manager import KVCacheManager
    from engine.sched.request import Sequence
    from engine.sched.scheduler import Scheduler

RATE_WINDOW_S = 1.0


@dataclass(slots=True)
class StepRecord:
    end: float
    duration_s: float
    num_tokens: int  # tokens computed (prefill + decode)
    has_decode: bool
    bytes_moved: int


class EngineStats:
    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.step = 0
        self.preemptions = {"recompute": 0, "swap": 0}
        self.swap_bytes = {"in": 0, "out": 0}
        self.prefix_queries_tokens = 0
        self.prefix_hits_tokens = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.tenants: dict[str, TenantUsage] = {}
        self.peak_bandwidth_bytes_per_s = 0.0
        self._window: deque[StepRecord] = deque()

    def tenant(self, name: str | None) -> TenantUsage | None:
        if name is None:
            return None
        usage = self.tenants.get(name)
        if usage is None:
            usage = self.tenants[name] = TenantUsage()
        return usage

    def on_preemption(self, seq: Sequence, mode: str, blocks_swapped: int) -> None:
        self.preemptions[mode] += 1
        self.swap_bytes["out"] += blocks_swapped * self.block_bytes
        if usage := self.tenant(seq.request.tenant):
            usage.preemptions_total += 1

    def on_swap_in(self, blocks: int) -> None:
        self.swap_bytes["in"] += blocks * self.block_bytes

    def on_prefix_lookup(self, queried: int, hits: int) -> None:
        self.prefix_queries_tokens += queried
        self.prefix_hits_tokens += hits

    def on_prompt(self, tenant: str | None, num_tokens: int) -> None:
        self.prompt_tokens += num_tokens
        if usage := self.tenant(tenant):
            usage.prompt_tokens_total += num_tokens

    def on_generated(self, tenant: str | None, num_tokens: int) -> None:
        self.generation_tokens += num_tokens
        if usage := self.tenant(tenant):
            usage.generation_tokens_total += num_tokens

    def on_step(self, duration_s: float, num_tokens: int, has_decode: bool, bytes_moved: int) -> None:
        self.step += 1
        now = time.monotonic()
        self._window.append(StepRecord(now, duration_s, num_tokens, has_decode, bytes_moved))
        self._trim(now)

    def snapshot(self, scheduler: Scheduler, model: str, healthy: bool = True) -> TelemetrySnapshot:
        kv: KVCacheManager = scheduler.kv
        now = time.monotonic()
        self._trim(now)
        steps = list(self._window)
        span = max(RATE_WINDOW_S, 1e-9) if steps else 1.0
        busy = sum(s.duration_s for s in steps)
        decode_steps = [s.duration_s for s in steps if s.has_decode]
        bytes_per_s = sum(s.bytes_moved for s in steps) / busy if busy > 0 else 0.0
        peak = self.peak_bandwidth_bytes_per_s
        return TelemetrySnapshot(
            time=time.time(),
            step=self.step,
            model=model,
            block_size=kv.block_size,
            num_blocks=kv.pool.num_blocks,
            free_blocks=kv.pool.num_free,
            cached_blocks=kv.pool.num_cached,
            swap_blocks=kv.swap.num_blocks,
            swap_used_blocks=kv.swap.num_used,
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_swapped=len(scheduler.swapped),
            preemptions_total=sum(self.preemptions.values()),
            preemptions_recompute_total=self.preemptions["recompute"],
            preemptions_swap_total=self.preemptions["swap"],
            prefix_cache_queries_total=self.prefix_queries_tokens,
            prefix_cache_hits_total=self.prefix_hits_tokens,
            prompt_tokens_total=self.prompt_tokens,
            generation_tokens_total=self.generation_tokens,
            step_time_s=busy / len(steps) if steps else 0.0,
            itl_s=sum(decode_steps) / len(decode_steps) if decode_steps else 0.0,
            tokens_per_s=sum(s.num_tokens for s in steps) / span,
            bytes_moved_per_s=bytes_per_s,
            peak_bandwidth_bytes_per_s=peak,
            bandwidth_utilization=min(1.0, bytes_per_s / peak) if peak > 0 else 0.0,
            healthy=healthy,
            tenants=self._tenant_usage(scheduler),
        )

    def _tenant_usage(self, scheduler: Scheduler) -> dict[str, TenantUsage]:
        """Counters plus live gauges; a block shared by two sequences of one tenant counts once."""
        result = {name: usage.model_copy(update={"blocks": 0, "running": 0, "waiting": 0})
                  for name, usage in self.tenants.items()}
        blocks: dict[str, set[int]] = {}
        for seq in scheduler.running:
            if (name := seq.request.tenant) is not None:
                result.setdefault(name, TenantUsage()).running += 1
                blocks.setdefault(name, set()).update(scheduler.kv.block_ids(seq))
        for seq in scheduler.waiting + scheduler.swapped:
            if (name := seq.request.tenant) is not None:
                result.setdefault(name, TenantUsage()).waiting += 1
        for name, ids in blocks.items():
            result[name].blocks = len(ids)
        return result

    def _trim(self, now: float) -> None:
        while self._window and now - self._window[0].end > RATE_WINDOW_S:
            self._window.popleft()
