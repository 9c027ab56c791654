"""Pydantic models shared by the engine and the guard. Importable without torch."""

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


class TelemetrySnapshot(BaseModel):
    """The engine's state after one step. Counters (``*_total``) only grow; rates cover the last second.

    ``free_blocks`` counts every reclaimable block, the ``cached_blocks`` among them included, so
    ``num_blocks - free_blocks`` is what running sequences hold.
    """

    model_config = ConfigDict(extra="forbid")

    time: float = Field(description="unix time of the snapshot")
    step: int
    model: str
    block_size: int
    num_blocks: int
    free_blocks: int
    cached_blocks: int
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
    tokens_per_s: float
    bytes_moved_per_s: float
    peak_bandwidth_bytes_per_s: float
    bandwidth_utilization: float = Field(ge=0.0, le=1.0)
    healthy: bool
    tenants: dict[str, TenantUsage] = Field(default_factory=dict)
