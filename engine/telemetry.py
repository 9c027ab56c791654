"""Engine telemetry: the step-time window, and the ``TelemetrySnapshot`` assembled from every part.

Each part keeps its own readings: the KV cache manager its pool and swap space, the scheduler its event
counters (``SchedulerStats``) and its load (``SchedulerLoad``). ``EngineStats`` adds what only the step loop
sees, the duration, tokens and bytes of each step, and assembles the snapshot from all of them.

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
from engine.sched.stats import SchedulerLoad, SchedulerStats

if TYPE_CHECKING:
    from engine.kv.manager import KVCacheManager

RATE_WINDOW_S = 1.0


@dataclass(slots=True)
class StepRecord:
    end: float
    duration_s: float
    num_tokens: int  # tokens computed (prefill + decode)
    has_decode: bool
    bytes_moved: int
    num_seqs: int  # sequences in the step


class EngineStats:
    def __init__(self, block_bytes: int, counters: SchedulerStats, peak_bandwidth_bytes_per_s: float) -> None:
        self.block_bytes = block_bytes
        self.counters = counters
        self.peak_bandwidth_bytes_per_s = peak_bandwidth_bytes_per_s
        self.step = 0
        self._window: deque[StepRecord] = deque()

    @property
    def swap_bytes(self) -> dict[str, int]:
        """Bytes copied by swap, per direction ("in" to the device, "out" to the host)."""
        return {direction: blocks * self.block_bytes for direction, blocks in self.counters.blocks_swapped.items()}

    def on_step(self, duration_s: float, num_tokens: int, has_decode: bool, bytes_moved: int, num_seqs: int) -> None:
        self.step += 1
        now = time.monotonic()
        self._window.append(StepRecord(now, duration_s, num_tokens, has_decode, bytes_moved, num_seqs))
        self._trim(now)

    def snapshot(
        self, model: str, kv: KVCacheManager, load: SchedulerLoad, healthy: bool = True
    ) -> TelemetrySnapshot:
        counters = self.counters
        now = time.monotonic()
        self._trim(now)
        steps = list(self._window)
        span = max(RATE_WINDOW_S, 1e-9) if steps else 1.0
        busy = sum(s.duration_s for s in steps)
        decode_steps = [s for s in steps if s.has_decode]
        bytes_per_s = sum(s.bytes_moved for s in steps) / busy if busy > 0 else 0.0
        peak = self.peak_bandwidth_bytes_per_s
        return TelemetrySnapshot(
            time=time.time(),
            step=self.step,
            model=model,
            block_size=kv.block_size,
            num_blocks=kv.pool.num_blocks,
            free_blocks=kv.pool.num_free - kv.pool.num_cached,
            cached_blocks=kv.pool.num_cached,
            swap_blocks=kv.swap.num_blocks,
            swap_used_blocks=kv.swap.num_used,
            num_running=load.num_running,
            num_waiting=load.num_waiting,
            num_swapped=load.num_swapped,
            preemptions_total=sum(counters.preemptions.values()),
            preemptions_recompute_total=counters.preemptions["recompute"],
            preemptions_swap_total=counters.preemptions["swap"],
            prefix_cache_queries_total=counters.prefix_queries_tokens,
            prefix_cache_hits_total=counters.prefix_hits_tokens,
            prompt_tokens_total=counters.prompt_tokens,
            generation_tokens_total=counters.generation_tokens,
            step_time_s=busy / len(steps) if steps else 0.0,
            itl_s=sum(s.duration_s for s in decode_steps) / len(decode_steps) if decode_steps else 0.0,
            itl_batch=sum(s.num_seqs for s in decode_steps) / len(decode_steps) if decode_steps else 0.0,
            tokens_per_s=sum(s.num_tokens for s in steps) / span,
            bytes_moved_per_s=bytes_per_s,
            peak_bandwidth_bytes_per_s=peak,
            bandwidth_utilization=min(1.0, bytes_per_s / peak) if peak > 0 else 0.0,
            healthy=healthy,
            tenants=self._tenant_usage(load),
            prefill_tokens=load.prefill_tokens,
        )

    def _tenant_usage(self, load: SchedulerLoad) -> dict[str, TenantUsage]:
        """Every tenant ever counted, plus any with live sequences: counters and live gauges together."""
        result = {
            name: TenantUsage(preemptions_total=c.preemptions, prompt_tokens_total=c.prompt_tokens,
                              generation_tokens_total=c.generation_tokens)
            for name, c in self.counters.tenants.items()
        }
        for name, live in load.tenants.items():
            usage = result.setdefault(name, TenantUsage())
            usage.blocks, usage.running, usage.waiting = live.blocks, live.running, live.waiting
        return result

    def _trim(self, now: float) -> None:
        while self._window and now - self._window[0].end > RATE_WINDOW_S:
            self._window.popleft()
