"""Background health checks: each engine backend's ``/health`` feeds its circuit breaker, and the guard's
mode is re-evaluated on every round (and on every telemetry snapshot or busy heartbeat, see app.py), so a
primary whose telemetry goes silent or whose step passes ``step_hang_s`` is down within a round."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from guard.config import Backend
from guard.runtime import GuardState

log = logging.getLogger("guard.pool.monitor")


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


async def monitor(state: GuardState) -> None:
    assert state.session is not None
    cfg = state.config
    timeout = aiohttp.ClientTimeout(total=cfg.routing.health_interval_s * 2)
    engines = [cfg.engine] + [f for f in cfg.fallbacks if isinstance(f, Backend)]
    while True:
        results = await asyncio.gather(*(probe(state.session, b, timeout) for b in engines))
        for backend, ok in zip(engines, results):
            breaker = state.breakers[backend.name]
            if ok:
                breaker.record_success()
                wanted = backend is not cfg.engine and backend.name not in state.fallback_models
                if wanted and (model := await fetch_model(state.session, backend, timeout)):
                    state.fallback_models[backend.name] = model
            else:
                breaker.record_failure()
            state.metrics.backend_healthy.labels(backend.name).set(1.0 if breaker.closed else 0.0)
        state.update_mode()
        state.update_detector()
        await asyncio.sleep(cfg.routing.health_interval_s)
