"""What the scheduler reports: counters of the events it causes, and the load it holds right now.

``SchedulerStats`` counters only grow; the scheduler bumps them as events happen. ``SchedulerLoad`` is a
gauge reading taken on demand. Neither knows about the telemetry wire format: ``engine.telemetry``
assembles the snapshot from these and the other parts' readings.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TenantCounters:
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


@dataclass(slots=True)
class SchedulerStats:
    preemptions: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})
    blocks_swapped: dict[str, int] = field(default_factory=lambda: {"in": 0, "out": 0})
    prefix_queries_tokens: int = 0  # prompt tokens looked up in the prefix cache at admission
    prefix_hits_tokens: int = 0  # ... of which the cache served
    prompt_tokens: int = 0  # counted once per request, when it samples its first token
    generation_tokens: int = 0
    tenants: dict[str, TenantCounters] = field(default_factory=dict)  # only requests that name a tenant

    def tenant(self, name: str) -> TenantCounters:
        counters = self.tenants.get(name)
        if counters is None:
            counters = self.tenants[name] = TenantCounters()
        return counters

    def on_preemption(self, tenant: str | None, mode: str, blocks_swapped_out: int) -> None:
        self.preemptions[mode] += 1
        self.blocks_swapped["out"] += blocks_swapped_out
        if tenant is not None:
            self.tenant(tenant).preemptions += 1

    def on_first_token(self, tenant: str | None, num_prompt_tokens: int) -> None:
        self.prompt_tokens += num_prompt_tokens
        if tenant is not None:
            self.tenant(tenant).prompt_tokens += num_prompt_tokens


@dataclass(slots=True)
class TenantLoad:
    blocks: int = 0  # device blocks its running sequences hold; a block two of them share counts once
    running: int = 0
    waiting: int = 0  # waiting or swapped out


@dataclass(slots=True)
class SchedulerLoad:
    num_running: int
    num_waiting: int
    num_swapped: int
    tenants: dict[str, TenantLoad]  # tenants with a live sequence, in order of first appearance
    # Engine priority -> tokens still to prefill: waiting sequences' uncomputed tokens (a cached prefix
    # counted whole: it is looked up only at admission) and running ones' past a decode's one.
    prefill_tokens: dict[int, int] = field(default_factory=dict)
