"""The guard's state as the console shows it: one JSON-ready dict built from ``GuardState``.

Read-only: it runs on the guard's event loop between two callbacks and never awaits, so it sees one
consistent state without locks, and it changes nothing the guard decides on (expiring a rate-limit window's
old entries, as the metrics scrape does too, changes no decision). Built about once a second per console.

What it may contain: tenant and replica names, numbers, states, the event feed. What it never contains: an
API key, a key digest, the salt secret (it reads tenants field by field, never dumps a ``Tenant`` or the
configuration), so the page and the stream can be shown on a shared screen.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any

from guard.config import Backend
from guard.instance import GuardState
from guard.pool.replica import Replica
from guard.pool.routing import CircuitBreaker

FEED_LIMIT = 50  # events a snapshot carries at most: what fits the console's list


def build(state: GuardState, events_after: int = 0, batches: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The whole console state; ``events`` holds the feed's events newer than ``events_after`` (a stream
    sends each event once); ``batches``: the batches this guard runs (guard/batch/runner.py ``table``)."""
    return {
        "batches": batches or [],
        "time": round(time.time(), 3),
        "guard": _guard(state),
        "replicas": [_replica(replica) for replica in state.pool],
        "fallbacks": _fallbacks(state),
        "tenants": _tenants(state),
        "events": state.events.since(events_after, FEED_LIMIT),
    }


def _guard(state: GuardState) -> dict[str, Any]:
    pool, modes = state.pool, state.modes
    return {
        "mode": modes.mode,
        "mode_for_s": round(time.monotonic() - modes.since, 1),
        "saturation": round(state.saturation(), 4),
        "pool_up": pool.any_up(),
        "budget_blocks": pool.budget(),
        "committed_blocks": pool.committed(),
        "queued_blocks": state.dispatcher.blocks_queued(),
        "queued_requests": state.dispatcher.fair.queued,
        "in_flight": state.in_flight,
        "jain_index": round(state.dispatcher.fair.jain_index(), 4),
        "policy": state.config.routing.policy,
        "event_seq": state.events.seq,
    }


def _circuit(breaker: CircuitBreaker) -> str:
    if breaker.closed:
        return "closed"
    return "half-open" if breaker.allow() else "open"


def _replica(replica: Replica) -> dict[str, Any]:
    """Its KV pool as the engine last reported it (``used + cached + free == total``) next to what the guard
    has reserved there (``reserved``) and may commit (``budget``); ``outside``: blocks held by traffic that
    did not come through the guard."""
    gate, snapshot = replica.gate, replica.gate.snapshot
    age = gate.telemetry_age()
    blocks: dict[str, int] = {"reserved": gate.reserved, "outside": gate.outside, "budget": gate.budget}
    engine: dict[str, Any] = {}
    if snapshot is not None:
        blocks |= {"total": snapshot.num_blocks, "used": snapshot.used_blocks,
                   "cached": snapshot.cached_blocks, "free": snapshot.free_blocks}
        engine = {"model": snapshot.model, "running": snapshot.num_running, "waiting": snapshot.num_waiting,
                  "preemptions_total": snapshot.preemptions_total,
                  "tokens_per_s": round(snapshot.tokens_per_s, 1),
                  "bandwidth_utilization": round(snapshot.bandwidth_utilization, 4)}
    return {
        "name": replica.name,
        "up": replica.up(),
        "circuit": _circuit(replica.breaker),
        "failures": replica.breaker.failures,
        "telemetry_age_s": None if math.isinf(age) else round(age, 3),
        "in_flight": replica.in_flight,
        "blocks": blocks,
        "engine": engine,
    }


def _fallbacks(state: GuardState) -> list[dict[str, Any]]:
    rows = []
    for fallback in state.config.fallbacks:
        engine = isinstance(fallback, Backend)
        circuit = _circuit(state.fallback_breakers[fallback.name]) if engine else "closed"  # a message cannot fail
        rows.append({"name": fallback.name, "kind": "engine" if engine else "static", "circuit": circuit})
    return rows


def _tenants(state: GuardState) -> list[dict[str, Any]]:
    """Every configured tenant, and each one a reload removed while it still has work here (``retired``).

    ``service_share`` is the tenant's part of all weighted service since the guard started, against its
    ``weight_share``: VTC keeps the two close for tenants that stay backlogged (the console also shows the
    share over the last minute, from the stream's history)."""
    dispatcher, pool = state.dispatcher, state.pool
    queues = dispatcher.fair.tenants
    configured = {tenant.name: tenant for tenant in state.config.tenants}
    total_weight = state.dispatcher.total_weight
    total_service = sum(queue.service for queue in queues.values())
    reserved = pool.reserved_by_tenant()
    running = Counter(reservation.tenant for reservation in pool.reservations().values())
    limits: dict[str, dict[str, dict[str, int]]] = {}
    for name, kind, limit, remaining in state.limiter.levels():
        limits.setdefault(name, {})[kind] = {"limit": limit, "remaining": remaining}
    rows = []
    for name in [*configured, *(name for name in queues if name not in configured)]:
        tenant, queue = configured.get(name), queues.get(name)
        signals = state.detector.tenants.get(name)
        service = queue.service if queue is not None else 0.0
        rows.append({
            "name": name,
            "retired": tenant is None,
            "lane": tenant.lane if tenant is not None else None,
            "weight": tenant.weight if tenant is not None else None,
            "weight_share": round(tenant.weight / total_weight, 4) if tenant is not None else 0.0,
            "queue_depth": len(queue) if queue is not None else 0,
            "reserved_blocks": reserved.get(name, 0),
            "running": running.get(name, 0),
            "service": round(service, 1),
            "service_share": round(service / total_service, 4) if total_service else 0.0,
            "block_cap_share": dispatcher.block_caps.get(name, tenant.max_blocks_share if tenant else 1.0),
            "limits": limits.get(name, {}),  # {"requests"|"tokens": {"limit", "remaining"}} for rpm and tpm
            "detector": {"state": signals.state, "suspicion": round(signals.score, 3),
                         "evidence": {k: round(v, 3) for k, v in signals.evidence.items()}}
            if signals is not None else {"state": "normal", "suspicion": 0.0, "evidence": {}},
        })
    return rows
