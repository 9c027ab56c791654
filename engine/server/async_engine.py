"""``AsyncEngine``: the engine core's step loop on its own thread, driven from an asyncio event loop.

::

    event loop (aiohttp handlers)                         engine thread
    ------------------------------                        ---------------------------------------
    add(request)  --\\                                      loads the model, then loops:
    abort(id)     ---+-- command queue (thread-safe) --->    apply queued commands (add/abort/read)
    recent_reading() /                                       step()  (one scheduled batch)
    RequestStream  <-- loop.call_soon_threadsafe -------     outputs, once per loop iteration,
    next_reading() <--+                                      with a reading while subscribed
    kv_events      <--/                                      and the step's KV-cache event batch
    step_running_s <-- one float (atomic) --------------     when the running step started

Only the engine thread changes the core once it is loaded; everything else reaches it through commands
that run between steps. So an abort frees its blocks at the next step boundary, and a reading (telemetry)
describes one step boundary exactly. The event loop may read what never changes after loading (config,
tokenizer, model name) and call ``EngineCore.make_request``, which only validates and tokenizes.

Telemetry subscribers do not poll: while any is subscribed, the engine thread attaches a reading to the
notification it sends after a step anyway, at most every ``PUBLISH_INTERVAL_S`` (and always before it goes
idle). So subscribers cost one snapshot per interval however many they are, and no extra wake-up of either
thread (each wake-up of the event loop takes the GIL from the stepping thread). Every reading taken for
anyone (``recent_reading()``, ``refresh()``) is published too, so a refresh asked for by one subscriber reaches all.

The prefix cache's KV events (engine/kv/events.py) ride on the same notification: the engine thread drains
the pool's event log once per loop iteration and posts the batch with the outputs, so the feed
(``kv_events``, engine/server/kv_events.py) sees every batch in order at no extra wake-up.

A step can take seconds (a long prefill on a CPU), and no reading can be had until it ends. The event loop
never has to wait for one to know the engine is alive: ``step_running_s`` says how long the running step
has run (None between steps), from the start time the engine thread writes before each step and clears
after it (a single attribute store, which the event loop reads without a lock). ``refresh()`` asks for a
reading without waiting for it, so the telemetry stream keeps talking during a long step.

Every added request ends in exactly one way: its final output, an error (``RequestFailed`` when a step
failed under it, ``EngineUnavailable`` when the engine stops, ``ResumeElsewhere`` when a drain ran out of
time), or an abort by its owner; its ``RequestStream`` says which.

Draining (``start_draining``, SIGTERM): the status turns ``draining`` (unhealthy, so /health says 503) and
every reading says ``draining``; the server admits nothing new, and ``drain`` waits for the requests
already added to finish, ending those still running at its deadline with ``ResumeElsewhere``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv.events import KVEventBatch
from engine.outputs import RequestOutput
from engine.request_stream import EngineUnavailable, RequestFailed, RequestStream, ResumeElsewhere
from engine.sched.request import Request
from engine.server.kv_events import KVEventFeed
from engine.server.metrics import EngineMetrics, EngineReading, LatencyRecorder
from engine.server.tracing import Timeline, record_step

log = logging.getLogger("engine.async")

# A step that fails fails the requests in it, and the engine goes on; this many failures in a row mean it
# cannot make progress, and it reports itself unhealthy until a step succeeds again.
MAX_CONSECUTIVE_STEP_FAILURES = 3
# While subscribed, a reading is published at most this often while busy (40/s; the contract asks for 20).
PUBLISH_INTERVAL_S = 0.025
# How often a drain looks whether every request has ended (a drain takes seconds: no event is worth it).
DRAIN_POLL_S = 0.02


@dataclass(slots=True)
class _Add:
    request: Request
    timeline: Timeline | None = None  # traced: the engine thread notes its steps there


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Read:
    future: concurrent.futures.Future[EngineReading]


class _Stop:
    pass


_Command = _Add | _Abort | _Read | _Stop


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.metrics = EngineMetrics()
        self.kv_events = KVEventFeed(config.block_size)
        self._latency = LatencyRecorder(self.metrics)
        self._core: EngineCore | None = None
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # makes "closed" and "enqueue" one step: no command is left behind
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._consecutive_failures = 0  # engine thread writes, event loop reads (an int: atomic)
        self._draining = False  # event loop writes, engine thread reads (a bool: atomic)
        self._subscribers = 0  # event loop writes, engine thread reads
        self._last_published = 0.0  # engine thread only
        self._readings = 0  # engine thread only: serial numbers put readings in order
        self._step_started: float | None = None  # engine thread writes (monotonic), event loop reads
        self._timelines: dict[str, Timeline] = {}  # engine thread only: traced requests still running
        # Event-loop side.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[None] | None = None
        self._failure: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}
        self._pending_read: asyncio.Future[EngineReading] | None = None
        self._published: EngineReading | None = None
        self._publication = asyncio.Event()

    # ----------------------------------------------------------------------------- event-loop side

    def start(self) -> None:
        """Start loading the model on the engine thread; call from the event loop that will use the engine."""
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._thread.start()

    async def wait_ready(self) -> None:
        """Return once the model is loaded; raise what loading raised if it failed."""
        assert self._ready is not None, "start() first"
        await asyncio.shield(self._ready)

    @property
    def ready(self) -> bool:
        return self._core is not None and self._failure is None and not self._closed

    @property
    def healthy(self) -> bool:
        return self.ready and not self._draining and self._consecutive_failures < MAX_CONSECUTIVE_STEP_FAILURES

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def status(self) -> str:
        """``loading``, ``ready``, ``draining``, ``degraded`` (steps keep failing), ``failed`` or ``stopped``."""
        if self._failure is not None:
            return "failed"
        if self._closed:
            return "stopped"
        if self._core is None:
            return "loading"
        if self._draining:
            return "draining"
        return "ready" if self.healthy else "degraded"

    def start_draining(self) -> None:
        """Turn ``draining``: the subscribers get a reading that says so at the next step boundary."""
        self._draining = True
        if self.ready:
            self.refresh()

    async def drain(self, timeout: float) -> int:
        """After ``start_draining``: wait until every added request has ended, at most ``timeout`` seconds;
        end those still running then with ``ResumeElsewhere``. Returns how many that ended."""
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        left = list(self._streams)
        self._fail_requests(left, ResumeElsewhere(
            f"the engine is draining and its drain timeout ({timeout:g} s) ended this request before it "
            "finished: resume it on another replica (resume_token_ids)"))
        for request_id in left:
            self.abort(request_id)
        return len(left)

    @property
    def core(self) -> EngineCore:
        """The loaded core, for its immutable parts and ``make_request`` (see the module docstring)."""
        if not self.ready:
            raise EngineUnavailable(f"the engine is {self.status}")
        assert self._core is not None
        return self._core

    @contextlib.contextmanager
    def subscription(self) -> Iterator[None]:
        """While held, the engine thread publishes readings for ``next_reading``."""
        self._subscribers += 1
        try:
            yield
        finally:
            self._subscribers -= 1

    @property
    def published(self) -> EngineReading | None:
        """The newest published reading (it may be old: nothing is published while nobody subscribes)."""
        return self._published

    @property
    def step_running_s(self) -> float | None:
        """Seconds the running step has run so far; None between steps."""
        started = self._step_started  # read once: the engine thread may clear it meanwhile
        return None if started is None else time.monotonic() - started

    async def next_reading(self, after: EngineReading | None, timeout: float) -> EngineReading | None:
        """The newest published reading if it is newer than ``after`` (any, if None), else the next one; None
        after ``timeout``. Readings are published during a ``subscription()`` as the state changes, and
        whenever one is taken (``recent_reading()``, ``refresh()``).
        """
        while self._published is None or (after is not None and self._published.serial <= after.serial):
            if not self.ready:
                raise EngineUnavailable(f"the engine is {self.status}")
            try:
                async with asyncio.timeout(timeout):
                    await self._publication.wait()
            except TimeoutError:
                return None
        return self._published

    def add(self, request: Request, timeline: Timeline | None = None) -> RequestStream:
        """Queue a request built by ``core.make_request``; its outputs arrive on the returned stream, and
        with a ``timeline`` (engine/server/tracing.py) its steps are noted there."""
        stream = RequestStream(request.request_id)
        self._submit(_Add(request, timeline))
        self._streams[request.request_id] = stream
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks at the next step boundary; its stream gets nothing more."""
        self._streams.pop(request_id, None)
        with contextlib.suppress(EngineUnavailable):  # a stopped engine has released everything already
            self._submit(_Abort(request_id))

    @contextlib.asynccontextmanager
    async def generate(self, request: Request, timeline: Timeline | None = None) -> AsyncIterator[RequestStream]:
        """``add`` for the span of a block: leaving it early (an error, a cancelled handler) aborts."""
        stream = self.add(request, timeline)
        try:
            yield stream
        finally:
            if not stream.done:
                self.abort(request.request_id)

    async def recent_reading(self, wait_s: float) -> EngineReading:
        """The state at the next step boundary if it comes within ``wait_s``; else (a long step runs) the newest
        published reading, an earlier boundary that is still consistent in itself; with none published, the
        next boundary however long it takes. For scrapes that must not time out on a busy engine. Concurrent
        callers share one reading."""
        pending = self._next_boundary_reading()
        try:
            return await asyncio.wait_for(asyncio.shield(pending), wait_s)
        except TimeoutError:
            if self._published is not None:
                return self._published
            return await asyncio.shield(pending)

    def refresh(self) -> None:
        """Ask for a reading at the next step boundary and publish it, without waiting (``next_reading``
        gets it); a no-op while one is pending."""
        self._next_boundary_reading()

    def _next_boundary_reading(self) -> asyncio.Future[EngineReading]:
        if self._pending_read is None or self._pending_read.done():
            future: concurrent.futures.Future[EngineReading] = concurrent.futures.Future()
            self._submit(_Read(future))
            self._pending_read = asyncio.wrap_future(future)
            self._pending_read.add_done_callback(self._publish_read)
        return self._pending_read

    async def shutdown(self) -> None:
        """Abort everything, release every block and stop the thread. Pending streams get ``EngineUnavailable``."""
        if self._thread.is_alive():
            with contextlib.suppress(EngineUnavailable):
                self._submit(_Stop())
            await asyncio.to_thread(self._thread.join)
        self._fail_all(EngineUnavailable("the engine has stopped"))

    def _submit(self, command: _Command) -> None:
        if not self.ready and not isinstance(command, (_Abort, _Stop)):
            raise EngineUnavailable(f"the engine is {self.status}")
        with self._lock:
            if self._closed:
                raise EngineUnavailable("the engine has stopped")
            self._commands.put(command)

    def _deliver(
        self, outputs: list[RequestOutput], reading: EngineReading | None, kv_batch: KVEventBatch | None
    ) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.push(output)
                if output.finished:
                    del self._streams[output.request_id]
        if reading is not None:
            self._publish(reading)
        if kv_batch is not None:
            self.kv_events.publish(kv_batch)

    def _publish_read(self, read: asyncio.Future[EngineReading]) -> None:
        # A failed read (the engine stopped) was the caller's to report; retrieving it here keeps asyncio quiet.
        if not read.cancelled() and read.exception() is None:
            self._publish(read.result())

    def _publish(self, reading: EngineReading) -> None:
        if self._published is not None and reading.serial <= self._published.serial:
            return  # a read and a publication of the same boundary can arrive in either order
        self._published = reading
        # Wake every waiter of this publication; the next one gets a fresh event.
        self._publication.set()
        self._publication = asyncio.Event()

    def _fail_requests(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.fail(error)

    def _fail_all(self, error: EngineUnavailable) -> None:
        self._fail_requests(list(self._streams), error)
        self._publication.set()  # subscribers wake up, and find the engine gone
        self.kv_events.close(error)

    def _loaded(self, core: EngineCore) -> None:
        self._core = core
        assert self._ready is not None
        self._ready.set_result(None)

    def _died(self, error: BaseException) -> None:
        self._failure = error
        assert self._ready is not None
        if not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()  # retrieved here; wait_ready() re-raises it for whoever asks
        self._fail_all(EngineUnavailable(f"the engine failed: {error!r}"))

    # ----------------------------------------------------------------------------- engine thread

    def _post(self, callback: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left to tell
            self._loop.call_soon_threadsafe(callback, *args)

    def _run(self) -> None:
        try:
            core = EngineCore(self.config)
        except BaseException as exc:  # noqa: BLE001 - whatever loading raised is the failure
            log.error("loading %s failed: %s", self.config.model, exc)
            self._close(None, [])
            self._post(self._died, exc)
            return
        self._post(self._loaded, core)
        try:
            leftover = self._serve(core)
        except BaseException as exc:  # a bug outside a step: the core can no longer be trusted
            log.exception("the engine loop failed")
            self._close(None, [])
            self._post(self._died, exc)
        else:
            self._close(core, leftover)
            self._post(self._fail_all, EngineUnavailable("the engine has stopped"))

    def _serve(self, core: EngineCore) -> list[_Command]:
        """Apply commands and step until told to stop; return the commands that came after the stop."""
        kv_log = core.kv.pool.record_events()  # drained below, once per iteration: every batch reaches the feed
        while True:
            changed = False
            commands = self._next_commands(block=not core.has_unfinished)
            for i, command in enumerate(commands):
                if isinstance(command, _Stop):
                    return commands[i + 1 :]
                changed |= self._apply(core, command)
            outputs = self._step(core) if core.has_unfinished else None
            if changed or outputs is not None:
                self._post(self._deliver, outputs or [], self._publication_due(core), kv_log.drain())

    def _next_commands(self, block: bool) -> list[_Command]:
        commands = [self._commands.get()] if block else []
        with contextlib.suppress(queue.Empty):
            while True:
                commands.append(self._commands.get_nowait())
        return commands

    def _apply(self, core: EngineCore, command: _Command) -> bool:
        """Run one command between steps; True when it changed the engine's state."""
        match command:
            case _Add(request, timeline):
                try:
                    core.add(request)
                except ValueError as exc:
                    self._post(self._fail_requests, [request.request_id], exc)
                    return False
                self._latency.start(request.request_id, request.arrival_time)
                if timeline is not None:
                    self._timelines[request.request_id] = timeline
                return True
            case _Abort(request_id):
                self._latency.forget(request_id)
                self._timelines.pop(request_id, None)
                return core.abort(request_id) is not None
            case _Read(future):
                if future.set_running_or_notify_cancel():
                    future.set_result(self._read(core))
                return False
        raise TypeError(f"unknown engine command {command!r}")

    def _step(self, core: EngineCore) -> list[RequestOutput]:
        started = self._step_started = time.monotonic()
        try:
            outputs = core.step()
        except Exception as exc:  # a failing step fails its requests, not the server
            log.exception("engine step failed; failing its %d requests", len(core.requests))
            failed = list(core.requests)
            for request_id in failed:
                core.abort(request_id)
                self._latency.forget(request_id)
                self._timelines.pop(request_id, None)
            self._consecutive_failures += 1
            self._post(self._fail_requests, failed, RequestFailed(f"the engine step failed: {exc!r}"))
            return []
        finally:
            self._step_started = None
        finished = time.monotonic()
        self._consecutive_failures = 0
        self.metrics.step_duration.observe(finished - started)
        self._latency.observe(outputs, finished)
        if self._timelines and core.last_schedule is not None:  # only while a traced request runs
            record_step(self._timelines, core.last_schedule, started, finished)
        return outputs

    def _publication_due(self, core: EngineCore) -> EngineReading | None:
        """A reading for the subscribers, if any, when the interval has passed or the engine goes idle."""
        if not self._subscribers:
            return None
        now = time.monotonic()
        if now - self._last_published < PUBLISH_INTERVAL_S and core.has_unfinished:
            return None
        self._last_published = now
        return self._read(core)

    def _read(self, core: EngineCore) -> EngineReading:
        self._readings += 1
        return EngineReading.of(core, self._consecutive_failures < MAX_CONSECUTIVE_STEP_FAILURES, self._readings,
                                self._draining)

    def _close(self, core: EngineCore | None, leftover: list[_Command]) -> None:
        """Refuse new commands, release every request (unless ``core`` is None: not to be trusted) and fail
        the readings still queued. Streams are failed by the caller, with the reason."""
        with self._lock:
            self._closed = True
        if core is not None:
            for request_id in list(core.requests):
                core.abort(request_id)
        stopped = EngineUnavailable("the engine has stopped")
        for command in leftover + self._next_commands(block=False):
            if isinstance(command, _Read) and command.future.set_running_or_notify_cancel():
                command.future.set_exception(stopped)
