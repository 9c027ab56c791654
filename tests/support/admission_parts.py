"""The guard's admission parts built without engines: a snapshot as an engine would send it, a one-replica
dispatcher over a real gate, tickets, the small config they come from, and a pool of three replicas on real
gates (``pool_of``, ``POOL_CONFIG``)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from engine.protocol import TelemetrySnapshot, TenantUsage
from guard.admission.dispatch import Dispatcher
from guard.admission.ticket import Ticket
from guard.config import Admission, GuardConfig, load_config
from guard.pool.gate import AdmissionGate
from guard.pool.pool import ReplicaPool
from guard.pool.replica import Replica
from guard.pool.routing import CircuitBreaker
from guard.pool.scheduling import profile_for

BASE = """
secret: test-secret
engine: {url: "http://127.0.0.1:8100"}
tenants:
  - {name: acme, api_keys: ["sk-a"], weight: 2}
  - {name: bulk, api_keys: ["sk-b"], lane: batch}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "guard.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def snapshot(num_blocks: int = 100, free: int = 100, block_size: int = 16, cached: int = 0,
             tenants_usage: dict[str, TenantUsage] | None = None, **tenants: int) -> TelemetrySnapshot:
    return TelemetrySnapshot(
        time=0, step=0, model="tiny", block_size=block_size, num_blocks=num_blocks, free_blocks=free,
        cached_blocks=cached, swap_blocks=0, swap_used_blocks=0, num_running=0, num_waiting=0, num_swapped=0,
        preemptions_total=0, preemptions_recompute_total=0, preemptions_swap_total=0,
        prefix_cache_queries_total=0, prefix_cache_hits_total=0, prompt_tokens_total=0,
        generation_tokens_total=0, step_time_s=0, itl_s=0, tokens_per_s=0, bytes_moved_per_s=0,
        peak_bandwidth_bytes_per_s=1, bandwidth_utilization=0, healthy=True,
        tenants=tenants_usage or {name: TenantUsage(blocks=b) for name, b in tenants.items()})


def make_dispatcher(tmp_path: Path, num_blocks: int = 100) -> tuple[Dispatcher, GuardConfig]:
    """A dispatcher in front of a pool of one replica with ``num_blocks`` free blocks."""
    config = load_config(write(tmp_path, BASE.replace("{name: acme,", "{name: acme, max_queue: 3,")))
    gate = AdmissionGate(config.admission, {t.name for t in config.tenants})
    gate.update(snapshot(num_blocks=num_blocks, free=num_blocks))
    replica = Replica(config.pool[0], gate, CircuitBreaker("primary", 3, 1.0))
    return Dispatcher(config, ReplicaPool([replica]), profile_for(config.routing)), config


def ticket(config: GuardConfig, tenant: int, blocks: int, rid: str, timeout: float | None = None) -> Ticket:
    t = config.tenants[tenant]
    lane = config.lanes[t.lane]
    if timeout is not None:
        lane = lane.model_copy(update={"timeout": timeout})
    return Ticket(rid, t, lane, prompt_tokens=10, max_tokens=10, blocks=blocks)


POOL_CONFIG = GuardConfig.model_validate({
    "engines": [{"name": f"e{i}", "url": f"http://127.0.0.1:{9000 + i}"} for i in range(3)], "secret": "s",
    "tenants": [{"name": "acme", "api_keys": ["sk-a"]}, {"name": "bulk", "api_keys": ["sk-b"]}]})


def pool_of(free: list[int], num_blocks: int = 100) -> ReplicaPool:
    """Replicas e0, e1, ... of ``POOL_CONFIG`` with ``num_blocks`` blocks each (budget 85), of which
    ``free[i]`` are free."""
    replicas = []
    for backend, idle in zip(POOL_CONFIG.pool, free):
        gate = AdmissionGate(Admission(safe_utilization=0.85), {"acme", "bulk"})
        gate.update(snapshot(num_blocks=num_blocks, free=idle))
        replicas.append(Replica(backend, gate, CircuitBreaker(backend.name, 3, 1.0)))
    return ReplicaPool(replicas)
