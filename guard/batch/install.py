"""The Batch API in the guard's app (guard/server/app.py calls ``install`` when ``batch`` is configured): its
routes, and a store and a runner per guard process, opened when the app starts and closed when it stops.

Order matters when the guard stops: the runner stops first (before the app turns its queued requests away),
so no line starts while the guard shuts down; its running lines are cancelled unrecorded and run again
wherever the batch goes on, and its leases go back at once.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from guard.batch.metrics import BatchMetrics
from guard.batch.routes import API, ROUTES, BatchApi, handler
from guard.batch.runner import BatchRunner
from guard.batch.store import open_store
from guard.instance import STATE

RUNNER = web.AppKey("batch runner", list)  # [BatchRunner, its task] once started


def install(app: web.Application) -> None:
    config = app[STATE].config.batch
    assert config is not None
    app[API] = BatchApi(config)
    app[RUNNER] = []
    for method, path, serve in ROUTES:
        app.router.add_route(method, path, handler(serve))
    app.on_startup.append(_start)
    app.on_shutdown.insert(0, _stop)
    app.on_cleanup.append(_close)


async def _start(app: web.Application) -> None:
    state, api = app[STATE], app[API]
    api.store = open_store(state.config)
    runner = BatchRunner(app, api.store, api.config, BatchMetrics(state.metrics))
    app[RUNNER].extend((runner, asyncio.create_task(runner.run(), name="batch runner")))


async def _stop(app: web.Application) -> None:
    if app[RUNNER]:
        runner, task = app[RUNNER]
        await runner.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _close(app: web.Application) -> None:
    if (store := app[API].store) is not None:
        await store.close()
