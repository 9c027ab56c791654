"""Engine KV cache & scheduler: where the blocks are, who holds them, what the scheduler does about it, and
how fast the engine turns them into tokens. Targets in the descriptions are reference 000's."""

from __future__ import annotations

from dashboards.grafana import Row, Target, dashboard, scope_variables, stat, table, timeseries
from dashboards.queries import quantile, rate, ratio, sel

UID = "kvguard-engine"
UP_DOWN = {0: ("down", "red"), 1: ("up", "green")}
PREFIX_HITS = "engine_prefix_cache_hits_tokens_total"
PREFIX_QUERIES = "engine_prefix_cache_queries_tokens_total"
PREFIX_EVICTIONS = "engine_prefix_cache_evictions_blocks_total"
TENANT_PREEMPTIONS = sel("engine_tenant_preemptions_total", tenant=True)
RECLAIMABLE = 'state=~"free|cached"'  # what a new request can get: free blocks and cached ones


def build() -> dict:
    return dashboard(
        UID, "kvguard / Engine KV cache & scheduler",
        "The engine's paged KV pool, scheduler queues, preemptions, prefix cache, LoRA adapters, step time, "
        "tokens/s and MBU.",
        scope_variables('label_values(engine_tenant_kv_blocks{job=~"$job", instance=~"$instance"}, tenant)'),
        [
            Row("KV cache", [
                timeseries("KV blocks by state",
                           "Device KV blocks: used (held by running sequences), cached (reclaimable, still "
                           "holding a prefix a later request may reuse) and free. The three sum to the "
                           "pool's capacity.",
                           "short", Target(f"sum by (instance, state) ({sel('engine_kv_blocks')})",
                                           "{{instance}} {{state}}"), stacked=True),
                stat("KV usage", "Share of the pool held by running sequences. The guard commits at most its "
                     "safe_utilization (0.85 by default), so a value above it means traffic bypasses the "
                     "guard or reservations are too small.", "percentunit",
                     Target(f"max by (instance) ({sel('engine_kv_usage_ratio')})", "{{instance}}"),
                     min=0, max=1, thresholds=[(0.85, "orange"), (0.95, "red")]),
                stat("Free headroom", "Free plus cached blocks over capacity: what a new request can get "
                     "without preempting anyone. Target: above 15 %.", "percentunit",
                     Target(ratio(f"sum by (instance) ({sel('engine_kv_blocks', RECLAIMABLE)})",
                                  f"sum by (instance) ({sel('engine_kv_blocks_capacity')})"), "{{instance}}"),
                     min=0, max=1, base="red", thresholds=[(0.05, "orange"), (0.15, "green")]),
                timeseries("KV blocks per tenant",
                           "Device blocks each tenant holds right now. One tenant holding most of the pool "
                           "while others queue is a noisy neighbour (or the fill phase of Fill-and-Squeeze).",
                           "short", Target(f"sum by (tenant) ({sel('engine_tenant_kv_blocks', tenant=True)})",
                                           "{{tenant}}"), stacked=True),
                timeseries("Host swap space", "Host swap blocks in use and free (swap preemption mode only).",
                           "short", Target(f"sum by (instance, state) ({sel('engine_swap_blocks')})",
                                           "{{instance}} {{state}}"), stacked=True),
            ]),
            Row("Scheduler", [
                timeseries("Sequences by queue",
                           "Sequences running, waiting for blocks, and swapped out. Behind the guard the "
                           "waiting queue stays short: the guard holds the backlog in its own fair queues.",
                           "short", Target(f"sum by (instance, state) ({sel('engine_requests')})",
                                           "{{instance}} {{state}}"), stacked=True),
                timeseries("Preemptions by mode",
                           "Sequences evicted to make room, by recompute or swap. Target: 0; any sustained "
                           "rate means the engine runs beyond its stable capacity.", "ops",
                           Target(f"sum by (instance, mode) ({rate(sel('engine_preemptions_total'))})",
                                  "{{instance}} {{mode}}")),
                timeseries("Preemptions per tenant",
                           "Whose sequences get evicted. A victim tenant preempted over and over while "
                           "another fills the pool is the squeeze phase of Fill-and-Squeeze.", "ops",
                           Target(f"sum by (tenant) ({rate(TENANT_PREEMPTIONS)})", "{{tenant}}")),
                timeseries("Swap traffic", "KV bytes copied between device and host, per direction. Both "
                           "directions busy at once is swap thrashing.", "Bps",
                           Target(f"sum by (instance, direction) ({rate(sel('engine_swap_bytes_total'))})",
                                  "{{instance}} {{direction}}")),
            ]),
            Row("Prefix cache", [
                timeseries("Prefix cache hit rate",
                           "Prompt tokens served from the prefix cache over prompt tokens looked up. Target: "
                           "above 40 % for templated traffic; a sudden drop is a miss storm (a template "
                           "changed).",
                           "percentunit",
                           Target(ratio(f"sum by (instance) ({rate(sel(PREFIX_HITS))})",
                                        f"sum by (instance) ({rate(sel(PREFIX_QUERIES))})"),
                                  "{{instance}}"), min=0, max=1),
                timeseries("Prefix cache evictions",
                           "Cached prefix blocks reclaimed for new KV. Target: below 1 block/s; more means "
                           "the working set of prefixes does not fit the pool.", "suffix: blocks/s",
                           Target(f"sum by (instance) ({rate(sel(PREFIX_EVICTIONS))})", "{{instance}}"),
                           thresholds=[(1, "red")]),
            ]),
            Row("LoRA adapters", [
                timeseries("Requests per adapter",
                           "Requests admitted per LoRA adapter (--lora, or loaded at runtime), all engines "
                           "together. Base-model requests are not counted here.", "reqps",
                           Target(f"sum by (lora) ({rate(sel('engine_lora_requests_total'))})", "{{lora}}")),
                timeseries("Adapters resident per engine",
                           "Adapters in an engine's device slots (--max-loras of them at most). A request for "
                           "an adapter that is not resident waits for a slot; the guard's adapter scorer "
                           "prefers the engines that have it.", "short",
                           Target(f"sum by (instance) ({sel('engine_lora_resident')})", "{{instance}}")),
                table("Adapter residency", "Per engine and adapter: 1 resident on the device, 0 served but "
                      "evicted (loaded again on its next request).",
                      Target(f"max by (instance, lora) ({sel('engine_lora_resident')})", "{{instance}} {{lora}}")),
            ]),
            Row("Throughput and latency", [
                timeseries("Tokens per second", "Prompt tokens prefilled and tokens generated per second.",
                           "suffix: tok/s",
                           Target(f"sum by (instance) ({rate(sel('engine_prompt_tokens_total'))})",
                                  "{{instance}} prompt"),
                           Target(f"sum by (instance) ({rate(sel('engine_generation_tokens_total'))})",
                                  "{{instance}} generated")),
                timeseries("Step time", "Wall time of one engine step (a batch of prefill chunks and decode "
                           "tokens), median and p99.", "s",
                           Target(quantile(0.5, "engine_step_duration_seconds", ("instance",)),
                                  "{{instance}} p50"),
                           Target(quantile(0.99, "engine_step_duration_seconds", ("instance",)),
                                  "{{instance}} p99")),
                timeseries("Memory bandwidth utilization (MBU)",
                           "Bytes moved per second of step time over the device's peak. Target under load: "
                           "75-88 %; low MBU with a queue means small batches or scheduling overhead.",
                           "percentunit",
                           Target(f"max by (instance) ({sel('engine_bandwidth_utilization_ratio')})",
                                  "{{instance}}"), min=0, max=1),
                timeseries("Memory bandwidth", "Bytes moved per second of step time: weights read, KV read "
                           "and written.", "Bps",
                           Target(f"max by (instance) ({sel('engine_memory_bandwidth_bytes_per_second')})",
                                  "{{instance}}")),
                timeseries("Engine TTFT p95 and ITL p99",
                           "Latency inside the engine, without the guard's queueing: compare with the SLO "
                           "dashboard to tell queueing from compute.", "s",
                           Target(quantile(0.95, "engine_time_to_first_token_seconds", ("instance",)),
                                  "{{instance}} TTFT p95"),
                           Target(quantile(0.99, "engine_inter_token_latency_seconds", ("instance",)),
                                  "{{instance}} ITL p99")),
                stat("Engine health", "1 while the engine serves requests (its /health), 0 while it loads or "
                     "after a fatal error.", "none", Target(f"min by (instance) ({sel('engine_healthy')})",
                                                            "{{instance}}"),
                     mappings=UP_DOWN),
                table("Model", "What each engine serves and how: model, device, dtype, KV block size.",
                      Target(f"max by (instance, model, device, dtype, block_size) ({sel('engine_info')})"),
                      width=18, height=5),
            ]),
        ],
    )
