"""A plan as JSON (``--json``: the contract's keys first, GiB to 0.01 as the contract quotes them, exact bytes
beside them) and as text for a person (the default)."""

from __future__ import annotations

import math
from typing import Any

from guard.plan.planner import Plan
from guard.plan.sizing import GB, GIB


def _gib(value: float) -> float:
    return round(value / GIB, 2)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no infinity: an unbounded wait is null


def to_json(plan: Plan) -> dict[str, Any]:
    s, shape = plan.sizing, plan.shape
    report: dict[str, Any] = {
        "pool_gib": _gib(s.pool_bytes), "demand_gib": round(s.demand_gib, 2), "safe_gib": _gib(s.safe_bytes),
        "fits_one_gpu": s.fits_one_gpu, "gpus_needed": s.gpus_needed,
        "demand_gib_exact": _gib(s.demand_bytes), "fits_raw_pool": s.fits_raw_pool, "blocker": s.blocker,
        "pool_bytes": s.pool_bytes, "safe_bytes": s.safe_bytes, "demand_bytes": s.demand_bytes,
        "margin": s.margin, "streams": s.streams, "slots_per_replica": s.slots_per_replica,
        "mean_sequence_bytes": s.mean_sequence_bytes,
        "model": {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
                  "kv_bytes": shape.kv_bytes, "weight_bytes": shape.weight_bytes,
                  "bytes_per_token": shape.bytes_per_token, "context_window": shape.context_window,
                  "source": shape.source},
        "pool_source": "engine" if plan.engine else "gpu",
        "classes": [{"name": c.name, "share": c.share, "context_tokens": c.context_tokens,
                     "sequence_bytes": c.sequence_bytes, "sequence_gib": c.quoted_gib, "streams": c.streams,
                     "aggregate_gib": round(c.streams * c.quoted_gib, 2)} for c in s.classes],
        "warnings": list(plan.warnings),
    }
    if plan.engine is not None:
        e = plan.engine
        report["engine"] = {"url": e.url, "model": e.model, "num_blocks": e.num_blocks,
                            "block_size": e.block_size, "dtype": e.dtype, "tokens": e.tokens}
    if (q := plan.queueing) is not None:
        report["queueing"] = {
            "server": "one concurrent stream slot: a replica's safe envelope over the mix's mean p95 sequence",
            "rate_per_s": q.arrivals.rate_per_s, "mean_service_s": q.arrivals.mean_service_s,
            "max_wait_s": q.arrivals.max_wait_s, "offered_erlangs": q.offered_erlangs,
            "slots_per_replica": q.slots_per_replica, "replicas_for_max_wait": q.replicas_for_max_wait,
            "replicas_needed": q.replicas_needed,
            "rows": [{"replicas": r.replicas, "servers": r.servers, "utilization": r.utilization,
                      "p_wait": r.p_wait, "mean_wait_s": _finite(r.mean_wait_s)} for r in q.rows],
        }
    return report


def to_text(plan: Plan) -> str:
    s, shape, w = plan.sizing, plan.shape, plan.workload
    window = f", a context window of {shape.context_window:,} tokens" if shape.context_window else ""
    lines = [(f"model: {shape.layers} layers x {shape.kv_heads} KV heads x {shape.head_dim} dims x "
             f"{shape.kv_bytes} B x 2 (K, V) = {shape.bytes_per_token:,} B of KV per token{window} "
             f"({shape.source})")]
    if plan.engine is not None:
        e = plan.engine
        lines.append(f"KV pool: engine {e.url} ({e.model}, {e.dtype or 'dtype unknown'}): {e.num_blocks} blocks "
                     f"x {e.block_size} tokens = {e.tokens:,} tokens = {s.pool_bytes / GIB:.4g} GiB")
    elif w.gpu is not None:
        lines.append(f"KV pool: {w.gpu.memory_gb:g} GB GPU ({round(w.gpu.memory_gb * GB) / GIB:.2f} GiB) - "
                     f"weights {shape.weight_bytes / GIB:.2f} GiB - runtime reserve "
                     f"{w.gpu.runtime_reserve_bytes / GIB:.2f} GiB = {s.pool_bytes / GIB:.2f} GiB")
    lines.append(f"per p95 sequence, at {w.streams} peak streams:")
    width = max(len(c.name) for c in s.classes)
    for c in s.classes:
        lines.append(f"  {c.name:<{width}}  {c.share:>4.0%}  {c.context_tokens:>8,} tokens  {c.quoted_gib:>8.3f} GiB"
                     f"  x {c.streams:5.1f} streams = {c.streams * c.quoted_gib:8.2f} GiB")
    lines.append(f"demand at peak: {s.demand_gib:.2f} GiB; safe envelope: pool x (1 - {s.margin:g}) = "
                 f"{s.safe_bytes / GIB:.2f} GiB")
    if s.blocker is not None:
        lines.append(f"verdict: cannot be served by replicas: {s.blocker}")
    elif s.fits_one_gpu:
        lines.append("verdict: fits one GPU's safe envelope: 1 GPU")
    else:
        raw = "inside" if s.fits_raw_pool else "over"
        lines.append(f"verdict: over one GPU's safe envelope ({s.demand_gib:.2f} > {s.safe_bytes / GIB:.2f} GiB), "
                     f"{raw} its raw pool: {s.gpus_needed} GPUs (replicas, each with the whole model)")
    if (q := plan.queueing) is not None:
        a = q.arrivals
        lines += [(f"queueing (Erlang-C; a server is one stream slot: {q.slots_per_replica} per replica = safe "
                  f"envelope / mean p95 sequence of {s.mean_sequence_bytes / GIB:.3g} GiB):"),
                  f"  offered load {q.offered_erlangs:g} Erlangs ({a.rate_per_s:g}/s x {a.mean_service_s:g} s)",
                  "  replicas  servers  utilization    P(wait)  mean wait"]
        lines += [f"  {r.replicas:>8}  {r.servers:>7}  {r.utilization:>11.0%}  {r.p_wait:>9.3g}  "
                  f"{'unbounded' if math.isinf(r.mean_wait_s) else f'{r.mean_wait_s:.3g} s':>9}" for r in q.rows]
        lines.append(f"  replicas for a mean wait <= {a.max_wait_s:g} s: {q.replicas_for_max_wait}; replicas "
                     f"needed (memory at peak and wait): {q.replicas_needed}")
    lines += [f"warning: {warning}" for warning in plan.warnings]
    return "\n".join(lines)
