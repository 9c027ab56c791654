"""Running batches: each guard looks for open batches, takes a batch's lease, and runs its lines.

``BatchRunner`` (one per guard process) looks every ``LOOK_S`` at the store's open batches and runs each one
whose lease it can take (store.py ``acquire``), as a ``BatchRun``. A run:

- reads the input file, and skips every line whose result is already recorded (a batch another guard, or
  this one before a restart, left half done resumes where it was; a line in flight when that guard died runs
  again, as its result was never recorded);
- starts a line whenever the pacer (pace.py) finds room, through the guard's own request path (line.py);
- records each line's answer as soon as it has one (results.py's line format): a line is done exactly when
  its result is recorded, and the store keeps only the first result of a line, so none is answered twice;
- keeps its lease, renewing it every ``lease_ttl_s / 3``, and stops starting lines the moment it cannot:
  another guard may have it by now. It also rereads the batch every ``LOOK_S`` for a cancel;
- ends when every line is done (``completed``), a cancel came (``cancelled``: no line starts after it, the
  running ones finish) or the completion window passed (``expired``: the same), and then writes the output
  and error files (``finalizing``) and the batch's final status.

A guard that shuts down cancels its lines (none recorded, so they run again) and gives its leases back, so
another guard, or the same one restarted, takes its batches over at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
import uuid

from aiohttp import web

from guard.batch import line as batch_line
from guard.batch.metrics import BatchMetrics
from guard.batch.objects import BatchObject, now
from guard.batch.pace import POLL_S, Pacer
from guard.batch.results import answer_line, output_files
from guard.batch.store import BatchStore
from guard.batch.validate import Line, Lines, parse_lines
from guard.config import Batch
from guard.errors import GuardError
from guard.instance import STATE

log = logging.getLogger("guard.batch")
LOOK_S = 0.5
MAX_BACKOFF_S = 5.0
OUTCOMES = {"ok": "completed", "failed": "failed", "retry": "retried"}  # guard_batch_requests_total's status


class BatchRunner:
    def __init__(self, app: web.Application, store: BatchStore, config: Batch, metrics: BatchMetrics) -> None:
        self.app, self.store, self.config, self.metrics = app, store, config, metrics
        self.owner = uuid.uuid4().hex[:12]
        self.pacer = Pacer(app[STATE], config.max_in_flight, config.max_slowdown)
        self.runs: dict[str, BatchRun] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.stopping = False

    async def run(self) -> None:
        """The guard's batch loop, for its lifetime."""
        while not self.stopping:
            try:
                await self.look()
            except Exception:  # a store that fails now (Redis away) is asked again at the next look
                log.exception("batch: looking for open batches failed")
            await asyncio.sleep(LOOK_S)

    async def look(self) -> None:
        for batch in await self.store.open_batches():
            if batch.id not in self.tasks and not self.stopping and \
                    await self.store.acquire(batch.id, self.owner, self.config.lease_ttl_s):
                run = self.runs[batch.id] = BatchRun(self, batch)
                self.tasks[batch.id] = asyncio.create_task(self._hold(run), name=f"batch {batch.id}")
        self.metrics.show_statuses(await self.store.statuses())
        pending: dict[str, int] = {}
        for run in self.runs.values():
            pending[run.batch.tenant] = pending.get(run.batch.tenant, 0) + run.pending
        self.metrics.show_pending(pending)

    async def _hold(self, run: BatchRun) -> None:
        try:
            await run.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s: its run failed; the lease goes back, and a guard takes it up again", run.batch.id)
        finally:
            self.runs.pop(run.batch.id, None)
            self.tasks.pop(run.batch.id, None)
            with contextlib.suppress(Exception):
                await self.store.release(run.batch.id, self.owner)

    def table(self) -> list[dict[str, object]]:
        """The batches this guard runs now, as the console lists them (ids, tenants and counts only)."""
        return [{"id": run.batch.id, "tenant": run.batch.tenant, "status": run.batch.shown_status(),
                 "total": run.batch.total, "pending": run.pending, "endpoint": run.batch.endpoint}
                for run in self.runs.values()]

    async def stop(self) -> None:
        """No line starts from now on; the running ones are cancelled (their results were not recorded, so
        they run again wherever the batch goes on) and the leases go back."""
        self.stopping = True
        tasks = list(self.tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class BatchRun:
    """One batch on this guard, under its lease (see the module)."""

    def __init__(self, runner: BatchRunner, batch: BatchObject) -> None:
        self.runner, self.batch, self.store = runner, batch, runner.store
        self.lost = False  # the lease could not be renewed: another guard may run the batch now
        self.pending = batch.total
        self.in_flight: set[asyncio.Task[None]] = set()
        self.engine_tries: dict[int, int] = {}
        self.backoff_until = 0.0

    async def run(self) -> None:
        lines = await self.load()
        if lines is None:
            return
        done = set(await self.store.results(self.batch.id))
        todo = collections.deque(line for line in lines.items if line.index not in done)
        self.pending = len(todo)
        if self.batch.status == "validating":
            self.batch.status, self.batch.in_progress_at = "in_progress", now()
            await self.store.save_batch(self.batch)
        keeper = asyncio.create_task(self.keep_lease(), name=f"batch lease {self.batch.id}")
        try:
            ending = await self.drive(lines, todo)
        finally:
            keeper.cancel()
            for task in self.in_flight:  # only when cancelled: drive waits for its lines otherwise
                task.cancel()
        if ending is not None and not self.lost and \
                await self.store.acquire(self.batch.id, self.runner.owner, self.runner.config.lease_ttl_s):
            await self.finalize(lines, ending)

    async def load(self) -> Lines | None:
        """The input file's lines; a batch whose file is gone or no longer valid fails."""
        batch = self.batch
        content = await self.store.content(batch.input_file_id)
        try:
            if content is None:
                raise GuardError(400, f"the input file {batch.input_file_id} no longer exists", code="file_not_found")
            # Off the loop: 50,000 lines take seconds to check, which the guard's requests must not wait for.
            return await asyncio.to_thread(parse_lines, content, max(batch.total, 1))
        except GuardError as exc:
            batch.status, batch.failed_at = "failed", now()
            batch.errors = {"object": "list", "data": [{"code": exc.code, "message": exc.message, "param": None,
                                                        "line": None}]}
            await self.store.save_batch(batch)
            return None

    def ending(self) -> str | None:
        """Why no more line may start: the batch was cancelled or expired; ``stopped`` (lease lost, or the
        guard stopping: the batch goes on elsewhere, and this guard does not finalize it); None: go on."""
        if self.lost or self.runner.stopping:
            return "stopped"
        if self.batch.cancelling_at is not None:
            return "cancelled"
        return "expired" if time.time() >= self.batch.expires_at else None

    async def drive(self, lines: Lines, todo: collections.deque[Line]) -> str | None:
        """Start lines while the batch may go on; the ending (None: stopped) once its running lines are done."""
        while (ending := self.ending()) is None:
            if not todo:
                if not self.in_flight:
                    ending = "completed"
                    break
                await asyncio.wait(self.in_flight, timeout=LOOK_S, return_when=asyncio.FIRST_COMPLETED)
                continue
            request_id = f"{self.batch.id}:{todo[0].index + 1}"
            if time.monotonic() < self.backoff_until or not self.runner.pacer.take(request_id):
                await asyncio.sleep(POLL_S)
                continue
            task = asyncio.create_task(self.one(lines.endpoint, todo.popleft(), request_id, todo))
            self.in_flight.add(task)
            task.add_done_callback(self.in_flight.discard)
        if self.in_flight:  # running lines finish, whatever the ending
            await asyncio.gather(*self.in_flight, return_exceptions=True)
        return None if ending == "stopped" else ending

    async def one(self, endpoint: str, line: Line, request_id: str, todo: collections.deque[Line]) -> None:
        """Run one line and record its answer; a line without its answer recorded goes back in ``todo``."""
        try:
            answer = await self.answer(endpoint, line, request_id)
            if answer is not None and answer.kind != "retry":
                if await self.store.record(self.batch.id, line.index, answer.kind == "ok",
                                           answer_line(line, request_id, answer.status, answer.body)):
                    self.pending -= 1
                return
        except asyncio.CancelledError:
            raise
        except Exception:  # the store failed to record it (or the pipeline to answer): the line runs again
            log.exception("batch %s: line %s is run again", self.batch.id, request_id)
            answer = None
        self.back_off(answer.retry_after if answer is not None else MAX_BACKOFF_S)
        todo.append(line)

    async def answer(self, endpoint: str, line: Line, request_id: str) -> batch_line.Answer | None:
        """The line's answer through the pipeline, sorted (line.py ``settle``); None while its tenant is gone
        (a reload removed it: its batch waits, and expires unless the tenant comes back)."""
        state, tenant_name = self.runner.app[STATE], self.batch.tenant
        try:
            tenant = next((t for t in state.config.tenants if t.name == tenant_name), None)
            if tenant is None:
                return None
            response = await batch_line.run_line(self.runner.app, endpoint, json.dumps(line.body).encode(),
                                                 request_id, tenant, batch_line.batch_lane(state.config))
        finally:
            self.runner.pacer.done(request_id)
        if response.status in batch_line.ENGINE_STATUSES:
            self.engine_tries[line.index] = self.engine_tries.get(line.index, 0) + 1
        answer = batch_line.settle(response, self.engine_tries.get(line.index, 0))
        self.runner.metrics.lines.labels(tenant_name, OUTCOMES[answer.kind]).inc()
        return answer

    def back_off(self, seconds: float) -> None:
        self.backoff_until = max(self.backoff_until, time.monotonic() + min(seconds, MAX_BACKOFF_S))

    async def keep_lease(self) -> None:
        """Renew the lease every ``lease_ttl_s / 3`` and reread the batch for a cancel every ``LOOK_S``; a
        lease not renewed within its TTL is lost (the store may be away: the batch is not this guard's then)."""
        ttl = self.runner.config.lease_ttl_s
        renewed = time.monotonic()
        while not self.lost:
            await asyncio.sleep(min(LOOK_S, ttl / 3))
            with contextlib.suppress(Exception):
                fresh = await self.store.batch(None, self.batch.id)
                if fresh is not None and fresh.cancelling_at is not None:
                    self.batch.cancelling_at = fresh.cancelling_at
            if time.monotonic() - renewed < ttl / 3:
                continue
            try:
                held = await self.store.acquire(self.batch.id, self.runner.owner, ttl)
            except Exception:  # noqa: BLE001 - a store that is away (Redis, the disk) raises its own errors
                held = time.monotonic() - renewed < ttl * 2 / 3  # a failed renewal: keep going while surely ours
            else:
                renewed = time.monotonic() if held else renewed
            self.lost = not held

    async def finalize(self, lines: Lines, ending: str) -> None:
        """The output and error files, then the batch's final status."""
        batch = self.batch
        batch.status, batch.finalizing_at = "finalizing", now()
        await self.store.save_batch(batch)
        output, errors = output_files(batch.id, batch.tenant, lines.items, await self.store.results(batch.id), ending)
        for made in (output, errors):
            if made is not None:
                await self.store.add_file(*made)
        batch.output_file_id = output[0].id if output is not None else None
        batch.error_file_id = errors[0].id if errors is not None else None
        batch.status = ending
        setattr(batch, f"{ending}_at", now())
        await self.store.save_batch(batch)
        self.pending = 0
