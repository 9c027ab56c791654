"""The engine's Prometheus metrics: state rendered from one reading per scrape, latencies as histograms.

Gauges and counters are not kept in ``prometheus_client`` objects that the engine thread updates: a scrape
takes one ``EngineReading`` at a step boundary and renders every state metric from it, so a scrape is
internally consistent and equals ``/telemetry`` taken at the same boundary. Histograms are observed on the
engine thread as steps complete (``prometheus_client`` histograms are thread-safe).

Label semantics:

- ``engine_kv_blocks{state}`` partitions the device pool, so the three states sum to
  ``engine_kv_blocks_capacity``: ``used`` blocks are held by running sequences, ``cached`` ones are
  reclaimable but still hold a prefix a later request may reuse, ``free`` ones hold nothing reusable.
  They are ``TelemetrySnapshot``'s ``free_blocks``, ``used_blocks`` and ``cached_blocks``, which partition
  the pool the same way.
- ``engine_requests{state}`` counts sequences: a request with ``n=2`` is two once it has forked.
- ``engine_e2e_request_latency_seconds`` covers requests that finished (stop or length), not aborted ones.

Histogram buckets run 1-2.5-5 per decade from well under a fast GPU's step to well over a slow CPU's, so
both land in the middle of the range rather than in the first or the overflow bucket.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.outputs import RequestOutput
from engine.protocol import TelemetrySnapshot

if TYPE_CHECKING:
    from engine.core import EngineCore


def _buckets(lowest: float, highest: float) -> tuple[float, ...]:
    """1, 2.5 and 5 times each power of ten from ``lowest`` up to ``highest``."""
    bounds = []
    decade = lowest
    while decade <= highest:
        bounds += [round(decade * m, 12) for m in (1.0, 2.5, 5.0) if decade * m <= highest]
        decade *= 10
    return tuple(bounds)


STEP_BUCKETS = _buckets(1e-4, 10.0)
TTFT_BUCKETS = _buckets(1e-3, 100.0)
ITL_BUCKETS = _buckets(1e-4, 10.0)
E2E_BUCKETS = _buckets(1e-2, 1000.0)


@dataclass(slots=True, frozen=True)
class EngineReading:
    """Everything a scrape renders, taken on the engine thread at one step boundary."""

    serial: int  # readings of one engine are numbered in the order they were taken
    snapshot: TelemetrySnapshot
    device: str
    dtype: str
    swap_bytes_in: int
    swap_bytes_out: int
    prefix_cache_evictions: int

    @classmethod
    def of(cls, core: EngineCore, healthy: bool, serial: int, draining: bool = False) -> EngineReading:
        snapshot = core.telemetry(healthy)
        snapshot.draining = draining
        return cls(serial, snapshot, str(core.device), str(core.dtype).removeprefix("torch."),
                   core.stats.swap_bytes["in"], core.stats.swap_bytes["out"], core.kv.pool.evictions_total)


class EngineMetrics:
    """One registry per engine, so several engines in one process (tests) never share a series."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.step_duration = Histogram("engine_step_duration_seconds", "Wall time of one engine step",
                                       buckets=STEP_BUCKETS, registry=self.registry)
        self.time_to_first_token = Histogram(
            "engine_time_to_first_token_seconds", "Arrival to first generated token, per request",
            buckets=TTFT_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(
            "engine_inter_token_latency_seconds", "Gap between consecutive tokens of one sequence",
            buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e_request_latency = Histogram(
            "engine_e2e_request_latency_seconds", "Arrival to last token, per finished request",
            buckets=E2E_BUCKETS, registry=self.registry)
        self._state = _StateCollector()
        self.registry.register(self._state)

    def render(self, reading: EngineReading | None) -> bytes:
        """The exposition text; ``reading`` is None while the model loads (only ``engine_healthy 0`` then)."""
        # Synchronous from here to the end: a concurrent scrape cannot swap the reading mid-render.
        self._state.reading = reading
        return generate_latest(self.registry)


class _StateCollector(Collector):
    def __init__(self) -> None:
        self.reading: EngineReading | None = None

    def describe(self) -> Iterable[Metric]:
        return []  # the families are only known at collection time

    def collect(self) -> Iterator[Metric]:
        reading = self.reading
        if reading is None:
            yield GaugeMetricFamily("engine_healthy", "1 when the engine serves requests", value=0)
            return
        snap = reading.snapshot
        used = snap.used_blocks
        yield _labelled(GaugeMetricFamily, "engine_kv_blocks", "Device KV blocks by state (they sum to capacity)",
                        "state", {"free": snap.free_blocks, "used": used, "cached": snap.cached_blocks})
        yield GaugeMetricFamily("engine_kv_blocks_capacity", "Device KV blocks in the pool", value=snap.num_blocks)
        yield GaugeMetricFamily("engine_kv_usage_ratio", "Share of device KV blocks held by running sequences",
                                value=used / snap.num_blocks)
        yield _labelled(GaugeMetricFamily, "engine_swap_blocks", "Host swap blocks by state", "state",
                        {"free": snap.swap_blocks - snap.swap_used_blocks, "used": snap.swap_used_blocks})
        yield _labelled(GaugeMetricFamily, "engine_requests", "Sequences by scheduler queue", "state",
                        {"running": snap.num_running, "waiting": snap.num_waiting, "swapped": snap.num_swapped})
        yield _labelled(CounterMetricFamily, "engine_preemptions", "Sequences preempted, by mode", "mode",
                        {"recompute": snap.preemptions_recompute_total, "swap": snap.preemptions_swap_total})
        yield _labelled(CounterMetricFamily, "engine_swap_bytes", "KV bytes copied between device and host",
                        "direction", {"in": reading.swap_bytes_in, "out": reading.swap_bytes_out})
        yield CounterMetricFamily("engine_prefix_cache_queries_tokens", "Prompt tokens looked up in the prefix cache",
                                  value=snap.prefix_cache_queries_total)
        yield CounterMetricFamily("engine_prefix_cache_hits_tokens", "Prompt tokens served by the prefix cache",
                                  value=snap.prefix_cache_hits_total)
        yield CounterMetricFamily("engine_prefix_cache_evictions_blocks", "Cached prefix blocks reused for new KV",
                                  value=reading.prefix_cache_evictions)
        yield CounterMetricFamily("engine_prompt_tokens", "Prompt tokens of requests that started generating",
                                  value=snap.prompt_tokens_total)
        yield CounterMetricFamily("engine_generation_tokens", "Tokens generated", value=snap.generation_tokens_total)
        yield GaugeMetricFamily("engine_memory_bandwidth_bytes_per_second",
                                "Bytes moved per second of step time (weights read, KV read and written)",
                                value=snap.bytes_moved_per_s)
        yield GaugeMetricFamily("engine_bandwidth_utilization_ratio",
                                "Memory bandwidth used over the device's peak (MBU)", value=snap.bandwidth_utilization)
        blocks = GaugeMetricFamily("engine_tenant_kv_blocks", "Device KV blocks held per tenant", labels=["tenant"])
        preemptions = CounterMetricFamily("engine_tenant_preemptions", "Preemptions per tenant", labels=["tenant"])
        for tenant, usage in sorted(snap.tenants.items()):
            blocks.add_metric([tenant], usage.blocks)
            preemptions.add_metric([tenant], usage.preemptions_total)
        yield blocks
        yield preemptions
        lora_requests = CounterMetricFamily("engine_lora_requests", "Requests admitted per LoRA adapter",
                                            labels=["lora"])
        resident = GaugeMetricFamily("engine_lora_resident", "1 for each LoRA adapter resident on the device",
                                     labels=["lora"])
        for name in snap.loras_available:
            lora_requests.add_metric([name], snap.lora_requests_total.get(name, 0))
            resident.add_metric([name], int(name in snap.loras))
        yield lora_requests
        yield resident
        yield GaugeMetricFamily("engine_healthy", "1 when the engine serves requests", value=int(snap.healthy))
        yield InfoMetricFamily("engine", "The served model and how it runs",
                               value={"model": snap.model, "block_size": str(snap.block_size),
                                      "device": reading.device, "dtype": reading.dtype})


def _labelled(family: type, name: str, documentation: str, label: str, values: dict[str, float]) -> Metric:
    metric = family(name, documentation, labels=[label])
    for value_label, value in values.items():
        metric.add_metric([value_label], value)
    return metric


@dataclass(slots=True)
class _Timing:
    arrival: float
    first_token_seen: bool = False
    tokens_seen: dict[int, int] = field(default_factory=dict)  # completion index -> tokens so far
    last_token_at: dict[int, float] = field(default_factory=dict)


class LatencyRecorder:
    """Turns the engine thread's step outputs into TTFT, inter-token and end-to-end latency observations.

    Times are ``time.monotonic()`` at the end of the step that produced the token, which is when the token
    exists; a sequence stalled by preemption shows the stall as one long inter-token gap.
    """

    def __init__(self, metrics: EngineMetrics) -> None:
        self._metrics = metrics
        self._live: dict[str, _Timing] = {}

    def start(self, request_id: str, arrival: float) -> None:
        self._live[request_id] = _Timing(arrival)

    def forget(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def observe(self, outputs: list[RequestOutput], now: float) -> None:
        for output in outputs:
            timing = self._live.get(output.request_id)
            if timing is None:
                continue
            for completion in output.outputs:
                count = completion.num_tokens
                before = timing.tokens_seen.get(completion.index, 0)
                if count == before:
                    continue
                if not timing.first_token_seen:
                    timing.first_token_seen = True
                    self._metrics.time_to_first_token.observe(now - timing.arrival)
                elif before:  # a fork's first token comes with its parent's, so it starts no gap
                    self._metrics.inter_token_latency.observe(now - timing.last_token_at[completion.index])
                timing.tokens_seen[completion.index] = count
                timing.last_token_at[completion.index] = now
            if output.finished:
                del self._live[output.request_id]
                if all(c.finish_reason != "abort" for c in output.outputs):
                    self._metrics.e2e_request_latency.observe(now - timing.arrival)
