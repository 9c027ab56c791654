"""The engine's telemetry on the wire: ``TelemetrySnapshot`` (one step's state, ``GET /telemetry`` and the
telemetry stream), a tenant's share of it, and the stream's busy heartbeat. The guard reads all three."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TenantUsage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    blocks: int = 0  # distinct device blocks held by the tenant's running sequences
    running: int = 0
    waiting: int = 0
    preemptions_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0


class StepProgress(BaseModel):
    """The payload of the telemetry stream's busy heartbeat (``: busy {...}``, an SSE comment sent while one
    step runs): the running step has run ``step_running_s``; ``step`` is the last snapshot this stream sent
    (None before the first), and no step boundary has been published since."""

    model_config = ConfigDict(extra="ignore")  # the engine may say more; these two are the contract

    step: int | None
    step_running_s: float = Field(ge=0)


class TelemetrySnapshot(BaseModel):
    """The engine's state after one step. Counters (``*_total``) only grow; rates cover the last second.

    The device pool is partitioned exactly as the metric ``engine_kv_blocks{state}`` partitions it:
    ``free_blocks + cached_blocks + used_blocks == num_blocks``. Free and cached blocks are both
    reclaimable (a new request can take either); a cached one still holds a prefix a later request may reuse.
    """

    model_config = ConfigDict(extra="forbid")

    time: float = Field(description="unix time of the snapshot")
    step: int
    model: str
    block_size: int
    num_blocks: int
    free_blocks: int = Field(description="device blocks that hold nothing: neither a running sequence's KV "
                             "nor a cached prefix")
    cached_blocks: int = Field(description="device blocks no running sequence holds that keep a reusable prefix")
    swap_blocks: int
    swap_used_blocks: int
    num_running: int
    num_waiting: int
    num_swapped: int
    preemptions_total: int
    preemptions_recompute_total: int
    preemptions_swap_total: int
    prefix_cache_queries_total: int = Field(description="prompt tokens looked up in the prefix cache")
    prefix_cache_hits_total: int = Field(description="prompt tokens served from the prefix cache")
    prompt_tokens_total: int
    generation_tokens_total: int
    step_time_s: float
    itl_s: float
    itl_batch: float = Field(default=0.0, description="mean sequences a step over the decode steps that itl_s "
                             "averages: the batch size to pair itl_s with (num_running is one instant's)")
    tokens_per_s: float
    bytes_moved_per_s: float
    peak_bandwidth_bytes_per_s: float
    bandwidth_utilization: float = Field(ge=0.0, le=1.0)
    healthy: bool
    tenants: dict[str, TenantUsage] = Field(default_factory=dict)
    loras: list[str] = Field(default_factory=list, description="LoRA adapters resident on the device now")
    loras_available: list[str] = Field(default_factory=list,
                                       description="LoRA adapters served here (a request names one as model)")
    lora_requests_total: dict[str, int] = Field(default_factory=dict, description="requests admitted per adapter")
    native_path: str = Field(default="off", description="the native CPU kernels in use: avx512, avx2, generic "
                             "or off (engine/kernels/native/library.py)")
    native_reason: str = Field(default="", description="why that path, and whether the decode step is native "
                               "(a failed build names its first error line)")
    prefill_tokens: dict[int, int] = Field(
        default_factory=dict, description="engine priority (lower first) -> prompt tokens still to prefill: "
        "waiting sequences' (a cached prefix counted whole) and running ones' not yet computed; what the "
        "guard's latency model reads other guards' and direct clients' work ahead from")
    draining: bool = Field(default=False, description="told to stop (SIGTERM): admits nothing new, finishes what "
                           "runs within its drain timeout, then exits")

    @property
    def used_blocks(self) -> int:
        """Device blocks held by running sequences: what is not reclaimable."""
        return self.num_blocks - self.free_blocks - self.cached_blocks
