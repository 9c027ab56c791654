"""Background health checks: each engine backend's ``/health`` (every replica of the pool, every engine
fallback) feeds its circuit breaker, and the guard's mode and the detector's verdicts are re-evaluated on
every round (the mode also on every telemetry snapshot or busy heartbeat, see app.py), so a replica whose
telemetry goes silent or whose step passes ``step_hang_s`` is down within a round, and one that answers
again rejoins the pool."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from guard.config import Backend
from guard.instance import GuardState

log = logging.getLogger("guard.server.monitor")


async def probe(session: aiohttp.ClientSession, backend: Backend, timeout: aiohttp.ClientTimeout) -> bool:
    try:
        async with session.get(backend.url.rstrip("/") + "/health", timeout=timeout) as response:
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def fetch_model(session: aiohttp.ClientSession, backend: Backend, timeout: aiohttp.ClientTimeout) -> str | None:
    try:
        async with session.get(backend.url.rstrip("/") + "/v1/models", timeout=timeout) as response:
            data = (await response.json()).get("data") or []
            return data[0]["id"] if data else None
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError):
        return None


async def monitor(state: GuardState, session: aiohttp.ClientSession) -> None:
    cfg = state.config
    timeout = aiohttp.ClientTimeout(total=cfg.routing.health_interval_s * 2)
    breakers = {r.name: r.breaker for r in state.pool} | state.fallback_breakers
    engines = cfg.pool + [f for f in cfg.fallbacks if isinstance(f, Backend)]
    while True:
        results = await asyncio.gather(*(probe(session, b, timeout) for b in engines))
        for backend, ok in zip(engines, results):
            breaker = breakers[backend.name]
            if ok:
                breaker.record_success()
                wanted = backend.name in state.fallback_breakers and backend.name not in state.fallback_models
                if wanted and (model := await fetch_model(session, backend, timeout)):
                    state.fallback_models[backend.name] = model
            else:
                breaker.record_failure()
            state.metrics.backend_healthy.labels(backend.name).set(1.0 if breaker.closed else 0.0)
        state.update_mode()
        state.escalation.evaluate()
        state.note_backends()  # replicas going down or up, into the console's event feed
        await asyncio.sleep(cfg.routing.health_interval_s)
