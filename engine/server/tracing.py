"""OpenTelemetry tracing of the engine's completions, on when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set.

A completion request is one SERVER span (``POST /v1/...``), a child of the caller's W3C ``traceparent``
(the guard's upstream span), with, for each engine request it made (a batch makes one per prompt):

    engine.queue     arrival until the first step that scheduled it
    engine.prefill   one per step that computed its prompt (chunked prefill), or recomputed it after a
                     preemption; attributes: the first position and the number of tokens
    engine.decode    first token until the end of the last step that ran it

and events on the SERVER span: ``first_token`` per engine request, ``preempted`` (mode, completion index)
at each preemption.

The step loop is not slowed and the HTTP side never waits on a step: the engine thread only appends the
times it already has (the step's start and end, ``AsyncEngine._step``) and what the scheduler's output
says (``SchedulerOutput.seqs`` and ``.preempted``) to the ``Timeline`` of each traced request in the
step, a dict lookup per scheduled sequence while any traced request is live, nothing otherwise. The spans
are built with those explicit times on the event loop when the HTTP request ends, from the timelines and
the ``Request`` objects (``arrival_time``, ``first_token_time``), and leave through the SDK's
``BatchSpanProcessor`` and ``OTLPSpanExporter``. Off, nothing is set up and no middleware is installed.
Invariant: a ``Timeline`` is written only by the engine thread and read by the event loop only after the
request's final output or its abort (a late append of an aborted request is harmless: it is not read).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from engine.sched.request import Request, SeqStatus

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

    from engine.sched.output import SchedulerOutput

log = logging.getLogger("engine.tracing")

SERVICE_NAME = "kvguard-engine"
SCOPE = "kvguard.engine"
ENABLED = False  # set by setup(): read it as ``tracing.ENABLED``
_provider: TracerProvider | None = None
_tracer: Tracer | None = None
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(slots=True, eq=False)
class Timeline:
    """What the engine thread saw of one request, in ``time.monotonic()`` seconds."""

    scheduled: float = 0.0  # start of the first step that ran it (0.0: never ran)
    last: float = 0.0  # end of the latest step that ran it
    prefills: list[tuple[float, float, int, int]] = field(default_factory=list)  # start, end, position, tokens
    preemptions: list[tuple[float, str, int]] = field(default_factory=list)  # time, mode, completion index


@dataclass(slots=True, eq=False)
class RequestTrace:
    """One HTTP request's engine requests and their timelines, until its spans are built."""

    started_ns: int
    requests: list[tuple[Request, Timeline]] = field(default_factory=list)


_TRACE = web.RequestKey("kvguard_trace", RequestTrace)


def record_step(timelines: dict[str, Timeline], out: SchedulerOutput, started: float, finished: float) -> None:
    """Engine thread, after a step: note it in the timelines of the traced requests it touched, and forget
    the requests it finished. Call only while ``timelines`` is not empty."""
    for seq, num_new in zip(out.seqs, out.num_new_tokens):
        timeline = timelines.get(seq.request.request_id)
        if timeline is None:
            continue
        if not timeline.scheduled:
            timeline.scheduled = started
        timeline.last = finished
        position = seq.num_computed_tokens - num_new  # committed already: where the chunk began
        if num_new > 1 or position < seq.num_prompt_tokens:  # a prompt chunk, or a recompute
            timeline.prefills.append((started, finished, position, num_new))
    for seq in out.preempted:
        if (timeline := timelines.get(seq.request.request_id)) is not None:
            mode = "swap" if seq.status is SeqStatus.SWAPPED else "recompute"
            timeline.preemptions.append((started, mode, seq.index))
    for seq in out.seqs:
        if seq.request.finished:
            timelines.pop(seq.request.request_id, None)


def timelines_for(http: web.Request, requests: list[Request]) -> list[Timeline | None]:
    """A fresh timeline per engine request of a traced HTTP request (Nones when it is not traced)."""
    trace = http.get(_TRACE) if ENABLED else None
    if trace is None:
        return [None] * len(requests)
    pairs = [(request, Timeline()) for request in requests]
    trace.requests += pairs
    return [timeline for _, timeline in pairs]


@web.middleware
async def trace_completions(http: web.Request, handler: Handler) -> web.StreamResponse:
    """The SERVER span of each completion request (``/v1/responses`` too), built once the request has ended."""
    if http.method != "POST" or not (http.path.endswith("completions") or http.path == "/v1/responses"):
        return await handler(http)
    trace = http[_TRACE] = RequestTrace(time.time_ns())
    status = 499  # the client left: the handler was cancelled
    try:
        response = await handler(http)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except Exception as exc:
        status = getattr(exc, "status", 500)
        raise
    finally:
        try:
            _emit(http, trace, status)
        except Exception:  # a tracing fault must never fail the request it describes
            log.exception("tracing: the spans of %s %s could not be built", http.method, http.path)


def _emit(http: web.Request, trace: RequestTrace, status: int) -> None:
    from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    if _tracer is None:
        return
    end_ns = time.time_ns()
    offset_ns = end_ns - time.monotonic_ns()

    def ns(at: float) -> int:
        return int(at * 1e9) + offset_ns

    parent = TraceContextTextMapPropagator().extract(http.headers)
    server = _tracer.start_span(f"{http.method} {http.path}", parent, SpanKind.SERVER, start_time=trace.started_ns,
                                attributes={"http.response.status_code": status,
                                            "kvguard.tenant": http.headers.get("X-Tenant-Id", "")})
    if status >= 500:
        server.set_status(Status(StatusCode.ERROR))
    inside = set_span_in_context(server)
    for request, timeline in trace.requests:
        _request_spans(server, inside, request, timeline, ns, end_ns)
    server.end(end_ns)


def _request_spans(server: Span, inside: object, request: Request, timeline: Timeline, ns: Callable[[float], int],
                   end_ns: int) -> None:
    assert _tracer is not None
    ident = {"kvguard.request_id": request.request_id}
    queued_until = ns(timeline.scheduled) if timeline.scheduled else end_ns
    _tracer.start_span("engine.queue", inside, start_time=ns(request.arrival_time),
                       attributes={**ident, "kvguard.prompt_tokens": len(request.prompt_token_ids)}).end(queued_until)
    for start, end, position, tokens in list(timeline.prefills):
        _tracer.start_span("engine.prefill", inside, start_time=ns(start), attributes={
            **ident, "kvguard.position": position, "kvguard.tokens": tokens}).end(ns(end))
    for at, mode, index in list(timeline.preemptions):
        server.add_event("preempted", {**ident, "kvguard.mode": mode, "kvguard.index": index}, ns(at))
    first = request.first_token_time
    if first is not None:
        server.add_event("first_token", {**ident, "kvguard.ttft_s": first - request.arrival_time}, ns(first))
        output_tokens = sum(seq.num_output_tokens for seq in request.seqs)
        _tracer.start_span("engine.decode", inside, start_time=ns(first), attributes={
            **ident, "kvguard.output_tokens": output_tokens}).end(ns(timeline.last) if timeline.last else end_ns)


def setup() -> None:
    """Start exporting if ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (idempotent); otherwise do nothing at all.
    ``service.name`` is kvguard-engine unless ``OTEL_SERVICE_NAME`` (or ``OTEL_RESOURCE_ATTRIBUTES``) names it."""
    global ENABLED, _provider, _tracer
    if _provider is not None or not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    _provider = TracerProvider(resource=Resource.create({} if named else {"service.name": SERVICE_NAME}))
    _provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _tracer = _provider.get_tracer(SCOPE)
    ENABLED = True


def shutdown() -> None:
    """Export what is left and stop the exporter's thread."""
    global ENABLED, _provider, _tracer
    if _provider is not None:
        ENABLED = False
        _provider.shutdown()
        _provider = _tracer = None
