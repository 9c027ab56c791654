"""OpenTelemetry tracing of the guard's requests, on when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set.

One request is one trace: the root span (SERVER, ``POST /v1/...``) continues the client's W3C
``traceparent`` when it sent one, and has the children

    guard.validate   authentication and validation of the body
    guard.admission  from the pool stage's start (token count, limits) until a replica admitted it
      guard.queue    the fair queue and the gate: ``Dispatcher.submit``, however long it waited
    guard.upstream   CLIENT: the request sent to the engine until its answer's last byte; the engine's
                     spans are its children (its id is the ``traceparent`` the engine gets); a stream's
                     first token is its ``first_token`` event
    guard.relay      the answer's headers until the last byte was handed to the client

Cost: off, ``ENABLED`` is False, nothing is set up and the pipeline only tests ``ex.trace is None``. On, a
request records monotonic timestamps in its ``GuardTrace`` (plain stores, no span objects), and at its end
the whole record goes to the ``BatchSpanProcessor`` at once; the spans are built and encoded on the
processor's thread, by guard/otlp.py (the SDK's encoder alone would cost more than the 10% budget).
Invariant: a record is never touched by the pipeline after ``finish``. A client's unsampled
``traceparent`` (flags 00) is honoured: nothing is recorded, and the header goes to the engine unchanged.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanContext, TraceFlags

from guard.otlp import CLIENT, INTERNAL, SERVER, Encoder, SpanData, readable_spans

log = logging.getLogger("guard.tracing")

SERVICE_NAME = "kvguard-guard"
SCOPE = "kvguard.guard"
ENABLED = False  # set by setup(): read it as ``tracing.ENABLED``, never import the name
_provider: TracerProvider | None = None
_processor: BatchSpanProcessor | None = None
# version-traceid-parentid-flags (W3C Trace Context); a later version may append fields after a dash.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


@dataclass(slots=True, eq=False)
class GuardTrace:
    """One request's timeline, in ``time.monotonic()`` seconds; 0.0: the stage was not reached."""

    trace_id: int
    parent_id: int  # the client's span, 0 when the trace starts at the guard
    root_id: int
    upstream_id: int
    sampled: bool
    name: str  # "POST /v1/completions"
    arrived: float
    incoming: Mapping[str, str] | None = None  # the client's tracestate, and its traceparent when unsampled
    validated: float = 0.0
    admission: float = 0.0
    queued: float = 0.0
    admitted: float = 0.0
    waited: bool = False  # the ticket went through the fair queue (not admitted at once)
    blocks: int = 0
    upstream: float = 0.0  # first attempt sent
    headers: float = 0.0  # the answer's headers came: the relay starts
    first_token: float = 0.0
    upstream_end: float = 0.0
    ended: float = 0.0
    backend: str = ""
    upstream_status: int = 0
    unavailable: tuple[tuple[float, str], ...] = ()  # attempts nothing could be sent to (rare: no list per request)
    token_events: int = 0
    status: int = 0
    tenant: str = ""
    outcome: str = ""
    request_id: str = ""

    @property
    def context(self) -> SpanContext:
        """The root span's context: what ``BatchSpanProcessor.on_end`` reads (it takes only sampled ones)."""
        return SpanContext(self.trace_id, self.root_id, False, _SAMPLED)

    def upstream_headers(self) -> Mapping[str, str]:
        """W3C headers for the engine: the upstream span as its parent, or the client's headers unchanged
        when the client did not sample."""
        if not self.sampled:
            return self.incoming or {}
        ours = {"traceparent": f"00-{self.trace_id:032x}-{self.upstream_id:016x}-01"}
        return {**ours, **self.incoming} if self.incoming else ours

    def spans(self) -> list[SpanData]:
        """The spans this timeline stands for (built on the export thread, not in the request)."""
        # Positional tuples (SpanData's field order): a NamedTuple built with keywords costs twice as much.
        end, root = self.ended, self.root_id
        new_id = random.getrandbits
        spans = [SpanData._make((self.name, SERVER, root, self.parent_id, self.arrived, end, {
            "kvguard.tenant": self.tenant, "kvguard.outcome": self.outcome,
            "http.response.status_code": self.status, "kvguard.request_id": self.request_id,  # unique: last
        }, (), self.status >= 500, self.parent_id != 0)),
            SpanData._make(("guard.validate", INTERNAL, new_id(64), root, self.arrived, self.validated or end, {}, (),
                            False, False))]
        if self.admission:
            admission_id = new_id(64)
            spans.append(SpanData._make(("guard.admission", INTERNAL, admission_id, root, self.admission,
                                         self.admitted or end, {"kvguard.blocks": self.blocks}, (), False, False)))
            if self.queued:
                spans.append(SpanData._make(("guard.queue", INTERNAL, new_id(64), admission_id, self.queued,
                                             self.admitted or end, {"kvguard.queued": self.waited}, (), False,
                                             False)))
        if self.upstream:
            events = tuple(("upstream_unavailable", at, {"kvguard.backend": name}) for at, name in self.unavailable)
            if self.first_token:
                events += (("first_token", self.first_token, {"kvguard.ttft_s": self.first_token - self.arrived}),)
            spans.append(SpanData._make(("guard.upstream", CLIENT, self.upstream_id, root, self.upstream,
                                         self.upstream_end or end, {"kvguard.backend": self.backend,
                                                                    "http.response.status_code": self.upstream_status},
                                         events, not 0 < self.upstream_status < 500, False)))
        if self.headers:
            spans.append(SpanData._make(("guard.relay", INTERNAL, new_id(64), root, self.headers, end,
                                         {"kvguard.token_events": self.token_events}, (), False, False)))
        return spans


def begin(headers: Mapping[str, str], method: str, path: str, arrived: float) -> GuardTrace:
    """A request's trace: a child of the client's ``traceparent`` when it sent a valid one, else a new trace."""
    parent = _TRACEPARENT.fullmatch(headers.get("traceparent", ""))
    new_id = random.getrandbits
    if (parent is None or parent[1] == "ff" or (parent[1] == "00" and parent[5]) or not int(parent[2], 16)
            or not int(parent[3], 16)):
        return GuardTrace(new_id(128), 0, new_id(64), new_id(64), True, f"{method} {path}", arrived)
    sampled = bool(int(parent[4], 16) & 1)
    state = headers.get("tracestate")
    incoming = {"tracestate": state} if state else None
    if not sampled:
        incoming = incoming or {}
        incoming["traceparent"] = parent[0]
    return GuardTrace(int(parent[2], 16), int(parent[3], 16), new_id(64), new_id(64), sampled,
                      f"{method} {path}", arrived, incoming)


def finish(trace: GuardTrace) -> None:
    """Hand a finished request's record to the exporter; the pipeline must not touch it afterwards."""
    if trace.sampled and _processor is not None:
        trace.ended = time.monotonic()
        _processor.on_end(trace)  # type: ignore[arg-type]  # a duck-typed span: see the module docstring


class GuardSpanExporter(SpanExporter):
    """``OTLPSpanExporter`` (HTTP/protobuf, configured by the standard ``OTEL_EXPORTER_OTLP_*`` variables)
    that encodes ``GuardTrace`` records with guard/otlp.py. Other spans (from a tracer on the global
    provider) go through the stock exporter. Where the installed exporter has no ``_client`` to send bytes
    with (its internals differ across versions), records become SDK spans and take the stock path too."""

    def __init__(self, resource: Resource) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        self.inner = OTLPSpanExporter()
        self.resource = resource
        self.encoder = Encoder(dict(resource.attributes), SCOPE)
        client = getattr(self.inner, "_client", None)
        self._send = getattr(client, "export", None)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        records = [s for s in spans if isinstance(s, GuardTrace)]
        others = [s for s in spans if not isinstance(s, GuardTrace)]
        result = SpanExportResult.SUCCESS
        offset_ns = time.time_ns() - time.monotonic_ns()
        if records and self._send is not None:
            data = self.encoder.encode(((r.trace_id, r.spans()) for r in records), offset_ns)
            if not getattr(self._send(data), "success", False):
                result = SpanExportResult.FAILURE
        elif records:
            others += [span for r in records for span in readable_spans(r.trace_id, r.spans(), self.resource,
                                                                        SCOPE, offset_ns)]
        if others and self.inner.export(others) is not SpanExportResult.SUCCESS:
            result = SpanExportResult.FAILURE
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def resource() -> Resource:
    """``service.name`` kvguard-guard, unless ``OTEL_SERVICE_NAME`` (or ``OTEL_RESOURCE_ATTRIBUTES``) names it."""
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    return Resource.create({} if named else {"service.name": SERVICE_NAME})


def setup() -> None:
    """Start exporting if ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (idempotent); otherwise do nothing at all."""
    global ENABLED, _provider, _processor
    if _provider is not None or not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return
    from opentelemetry import trace

    res = resource()
    _processor = BatchSpanProcessor(GuardSpanExporter(res))
    _provider = TracerProvider(resource=res)
    _provider.add_span_processor(_processor)
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):  # settable once per process
        trace.set_tracer_provider(_provider)  # a later instrumentation's spans join the same pipeline
    ENABLED = True
    log.info("tracing: exporting spans to %s as %s", os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"],
             res.attributes.get("service.name"))


def shutdown() -> None:
    """Export what is left and stop the exporter's thread."""
    global ENABLED, _provider, _processor
    if _provider is not None:
        ENABLED = False
        _provider.shutdown()
        _provider = _processor = None
