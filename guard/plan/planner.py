"""A plan from a workload: the model's shape, the pool (a GPU's, or a live engine's), the sizing, the queue.

``make_plan`` is the one entry point; the CLI (``__main__.py``) and the tests call it the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from guard.plan.engine_pool import EnginePool, read_engine
from guard.plan.model_shape import KvShape, resolve_shape
from guard.plan.queueing import QueueRow, queue_row, replicas_for_wait
from guard.plan.sizing import Sizing, gpu_pool_bytes, size
from guard.plan.workload import Arrivals, ExplicitModel, PlanError, Workload


@dataclass(slots=True, frozen=True)
class Queueing:
    """Erlang-C over stream slots. Invariant: ``replicas_needed = max(gpus_needed, replicas_for_max_wait)``;
    ``rows`` holds fleets of 1 .. ``replicas_needed`` replicas."""

    arrivals: Arrivals
    offered_erlangs: float
    slots_per_replica: int
    replicas_for_max_wait: int
    replicas_needed: int
    rows: tuple[QueueRow, ...]


@dataclass(slots=True, frozen=True)
class Plan:
    workload: Workload
    shape: KvShape
    sizing: Sizing
    engine: EnginePool | None  # set with --from-engine: the pool is that engine's
    queueing: Queueing | None  # None without arrivals, or when a blocker leaves no replica to queue on
    warnings: tuple[str, ...]


def make_plan(workload: Workload, base: Path, engine_url: str | None = None) -> Plan:
    """The plan of ``workload`` (relative model paths from ``base``); with ``engine_url``, on that engine's
    pool instead of the workload's GPU. Raises `PlanError` when the input cannot give a plan."""
    warnings: list[str] = []
    engine = read_engine(engine_url) if engine_url else None
    shape = resolve_shape(workload.model, base, engine.kv_bytes if engine else None)
    if engine is not None:
        if workload.gpu is not None:
            warnings.append("gpu: ignored, the KV pool is the engine's")
        if isinstance(workload.model, ExplicitModel) and engine.kv_bytes not in (None, shape.kv_bytes):
            warnings.append(f"model.kv_bytes is {shape.kv_bytes} but the engine caches {engine.dtype} "
                            f"({engine.kv_bytes} bytes): GiB figures are scaled by {shape.kv_bytes}/{engine.kv_bytes}")
        pool_bytes = engine.tokens * shape.bytes_per_token
        sizing = size(workload.mix, workload.streams, workload.margin, pool_bytes, shape.bytes_per_token,
                      engine.block_size, shape.context_window)
    elif workload.gpu is None:
        raise PlanError("gpu: required (memory_gb, runtime_reserve_bytes) unless the pool comes from "
                        "--from-engine URL")
    else:
        pool_bytes = gpu_pool_bytes(workload.gpu.memory_gb, shape.weight_bytes, workload.gpu.runtime_reserve_bytes)
        sizing = size(workload.mix, workload.streams, workload.margin, pool_bytes, shape.bytes_per_token,
                      context_window=shape.context_window)
    queueing = None
    if workload.arrivals is not None:
        if sizing.slots_per_replica is None or sizing.gpus_needed is None:
            warnings.append("arrivals: no queueing figures, no replica can hold the workload (see the verdict)")
        else:
            queueing = _queueing(workload.arrivals, sizing.slots_per_replica, sizing.gpus_needed)
    return Plan(workload, shape, sizing, engine, queueing, tuple(warnings))


def _queueing(arrivals: Arrivals, slots: int, gpus_needed: int) -> Queueing:
    for_wait = replicas_for_wait(slots, arrivals.rate_per_s, arrivals.mean_service_s, arrivals.max_wait_s)
    needed = max(gpus_needed, for_wait)
    rows = tuple(queue_row(n, slots, arrivals.rate_per_s, arrivals.mean_service_s) for n in range(1, needed + 1))
    return Queueing(arrivals, arrivals.rate_per_s * arrivals.mean_service_s, slots, for_wait, needed, rows)
