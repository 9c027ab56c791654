"""Where a benchmark phase's time went, for a guard in front of one engine: read before and after the phase
(and sampled during it), so a figure that misses its target comes with the reason in the same report.

- the engine's steps: how many, their mean duration (``engine_step_duration_seconds``), the sequences it ran
  per step and the KV blocks in use (its telemetry, sampled every ``SAMPLE_S``);
- a tenant's time in the guard: the mean queue wait (``guard_queue_wait_seconds``) and the mean TTFT the guard
  saw (``guard_time_to_first_token_seconds``), so a TTFT can be split into waiting for admission and the rest;
- each process's CPU: seconds on a CPU and seconds runnable but waiting for one (bench/proc_stats.py), over
  the phase, per named process (the engine, the guard, the load generator itself). On 2 cores, the sum of
  the CPU seconds near 2 x the phase's length says the processes contend for the CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Self

from proc_stats import sched_seconds
from prometheus_client.parser import text_string_to_metric_families
from stack import get_json

SAMPLE_S = 0.2


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` as {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=5.0) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(value for (sample, have), value in samples.items() if sample == name and wanted <= set(have))


@dataclass
class Probe:
    """``async with Probe(engine_url, guard_url, tenant, pids) as probe`` around a phase; then ``probe.report``.
    ``pids``: name -> (pid, whether its children count as its own)."""

    engine_url: str
    guard_url: str
    tenant: str
    pids: dict[str, tuple[int, bool]]
    report: dict = field(default_factory=dict)

    async def __aenter__(self) -> Self:
        self.samples: list[dict] = []
        self.started = time.monotonic()
        self.cpu = {name: sched_seconds(*pid) for name, pid in self.pids.items()}
        self.engine, self.guard = await asyncio.gather(asyncio.to_thread(scrape, self.engine_url),
                                                       asyncio.to_thread(scrape, self.guard_url))
        self.sampler = asyncio.create_task(self.sample())
        return self

    async def sample(self) -> None:
        while True:
            snap = await asyncio.to_thread(get_json, self.engine_url + "/telemetry")
            self.samples.append({"running": snap["num_running"], "waiting": snap["num_waiting"],
                                 "used_blocks": snap["num_blocks"] - snap["free_blocks"] - snap["cached_blocks"]})
            await asyncio.sleep(SAMPLE_S)

    async def __aexit__(self, *exc: object) -> None:
        self.sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.sampler
        elapsed = time.monotonic() - self.started
        engine, guard = await asyncio.gather(asyncio.to_thread(scrape, self.engine_url),
                                             asyncio.to_thread(scrape, self.guard_url))
        self.report = {"seconds": elapsed, **self.steps(engine), **self.guard_times(guard),
                       "cpu": self.cpu_used(elapsed), **self.occupancy()}

    def steps(self, engine: dict) -> dict:
        def grew(name: str) -> float:
            return total(engine, name) - total(self.engine, name)
        steps = grew("engine_step_duration_seconds_count")
        return {"engine_steps": steps,
                "engine_step_mean_ms": 1e3 * grew("engine_step_duration_seconds_sum") / steps if steps else None,
                "engine_busy_share": grew("engine_step_duration_seconds_sum") / (time.monotonic() - self.started)}

    def guard_times(self, guard: dict) -> dict:
        def mean_ms(histogram: str) -> float | None:
            count = total(guard, histogram + "_count", tenant=self.tenant) - \
                total(self.guard, histogram + "_count", tenant=self.tenant)
            seconds = total(guard, histogram + "_sum", tenant=self.tenant) - \
                total(self.guard, histogram + "_sum", tenant=self.tenant)
            return 1e3 * seconds / count if count else None
        return {f"{self.tenant}_queue_wait_mean_ms": mean_ms("guard_queue_wait_seconds"),
                f"{self.tenant}_guard_ttft_mean_ms": mean_ms("guard_time_to_first_token_seconds")}

    def cpu_used(self, elapsed: float) -> dict:
        used = {}
        for name, pid in self.pids.items():
            on_cpu, waiting = sched_seconds(*pid)
            used[name] = {"cpu_share": (on_cpu - self.cpu[name][0]) / elapsed,
                          "runnable_waiting_share": (waiting - self.cpu[name][1]) / elapsed}
        return used

    def occupancy(self) -> dict:
        if not self.samples:
            return {}
        n = len(self.samples)
        return {key + "_mean": sum(s[key] for s in self.samples) / n for key in ("running", "waiting", "used_blocks")}
