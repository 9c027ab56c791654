"""The guard's spans on the OTLP wire: a request's spans encoded straight to protobuf bytes.

Why not the SDK's encoder: it builds a protobuf object per span, key-value and event, about 30 us per span
on the reference VM, and the guard's whole budget for tracing is 10% of ~440 us per request (six spans).
Spans here are plain ``SpanData`` tuples; the constant parts (resource, scope, span names, attribute keys)
are encoded once and cached. ``decode`` of the result equals the SDK's encoding of the same spans
(tests/e2e/test_tracing.py checks it field for field), so a collector cannot tell the two apart.

Supported: what the guard emits. Attribute values are str, bool, int or float; events carry such
attributes; no links, no trace state. Times are ``time.monotonic()`` seconds, turned into Unix
nanoseconds with the offset the caller passes (one per export batch, so a clock step moves whole batches).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan

AttributeValue = str | bool | int | float

# SpanKind as OTLP numbers it (opentelemetry/proto/trace/v1/trace.proto).
INTERNAL, SERVER, CLIENT = 1, 2, 3
STATUS_UNSET, STATUS_ERROR = 0, 2
# What ends a span: its Status (always present, as the SDK writes it; code ERROR or nothing), then Span.flags:
# "the parent's remoteness is known" and, for a span whose parent is in another process, "it is remote".
_ENDINGS = {(error, remote): (b"\x7a\x02\x18\x02" if error else b"\x7a\x00")
            + b"\x85\x01" + struct.pack("<I", 0x300 if remote else 0x100)
            for error in (False, True) for remote in (False, True)}
_times = struct.Struct("<BQBQ").pack  # Span.start_time_unix_nano and Span.end_time_unix_nano, fixed64 each
_fixed64 = struct.Struct("<Q").pack
_double = struct.Struct("<d").pack


class SpanData(NamedTuple):
    """One finished span. ``parent_id`` 0: a root span. Times in monotonic seconds."""

    name: str
    kind: int
    span_id: int
    parent_id: int
    start: float
    end: float
    attributes: Mapping[str, AttributeValue]
    events: tuple[tuple[str, float, Mapping[str, AttributeValue]], ...] = ()
    error: bool = False
    remote_parent: bool = False  # the parent span is in another process (the client's)


def varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    if value < 0x4000:  # most lengths here: a span is a few hundred bytes
        return bytes((value & 0x7F | 0x80, value >> 7))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field: its tag byte, the length, the payload."""
    return bytes((tag,)) + varint(len(payload)) + payload


@functools.cache
def _key(key: str) -> bytes:
    return _field(0x0A, key.encode())  # KeyValue.key


@functools.cache
def _head(name: str, kind: int) -> bytes:
    return _field(0x2A, name.encode()) + bytes((0x30, kind))  # Span.name, Span.kind


def _any_value(value: AttributeValue) -> bytes:
    if isinstance(value, str):
        return _field(0x0A, value.encode())
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + varint(value & 0xFFFFFFFFFFFFFFFF)  # int64: two's complement, as protobuf does
    if isinstance(value, float):
        return b"\x21" + _double(value)
    return _field(0x0A, str(value).encode())


def _attribute(tag: int, key: str, value: AttributeValue) -> bytes:
    return _field(tag, _key(key) + _field(0x12, _any_value(value)))


def attributes(tag: int, values: Mapping[str, AttributeValue]) -> bytes:
    """Repeated ``KeyValue`` under field ``tag`` (Span.attributes, Event.attributes, Resource.attributes)."""
    return b"".join([_attribute(tag, k, v) for k, v in values.items()])


# A span's name, kind and attributes mostly repeat from request to request (the same stage, tenant, outcome,
# backend, status code, small counts): encoded once, then looked up. Attributes under UNIQUE keys (one
# value per request) are left out of the lookup and encoded each time; they come last in the span's
# attributes, which OTLP reads as a map (order carries nothing). Put them last to keep the order too.
UNIQUE = frozenset({"kvguard.request_id"})


@functools.lru_cache(maxsize=4096)
def _static(name: str, kind: int, values: tuple[tuple[str, AttributeValue], ...]) -> bytes:
    return _head(name, kind) + b"".join([_attribute(0x4A, k, v) for k, v in values])  # Span.attributes


def _described(name: str, kind: int, values: Mapping[str, AttributeValue]) -> bytes:
    if UNIQUE.isdisjoint(values):
        return _static(name, kind, tuple(values.items()))
    return (_static(name, kind, tuple([(k, v) for k, v in values.items() if k not in UNIQUE]))
            + b"".join([_attribute(0x4A, k, values[k]) for k in UNIQUE if k in values]))


def _span(trace_head: bytes, span: SpanData, offset_ns: int) -> bytes:
    """``trace_head``: Span.trace_id's field and Span.span_id's tag, the same for every span of a trace."""
    name, kind, span_id, parent_id, start, end, values, events, error, remote = span
    body = b"".join((
        trace_head, span_id.to_bytes(8, "big"), b"\x22\x08" + parent_id.to_bytes(8, "big") if parent_id else b"",
        _times(0x39, int(start * 1e9) + offset_ns, 0x41, int(end * 1e9) + offset_ns), _described(name, kind, values),
        b"".join([_event(event, offset_ns) for event in events]) if events else b"",
        _ENDINGS[error, remote]))
    return b"\x12" + varint(len(body)) + body  # ScopeSpans.spans


def _event(event: tuple[str, float, Mapping[str, AttributeValue]], offset_ns: int) -> bytes:
    name, at, values = event
    body = b"\x09" + _fixed64(int(at * 1e9) + offset_ns) + _field(0x12, name.encode())
    return _field(0x5A, body + attributes(0x1A, values) if values else body)  # Span.events


class Encoder:
    """``ExportTraceServiceRequest`` bytes for the spans of one resource and one instrumentation scope."""

    def __init__(self, resource: Mapping[str, AttributeValue], scope: str) -> None:
        self._resource = _field(0x0A, attributes(0x0A, resource))  # ResourceSpans.resource
        self._scope = _field(0x0A, _field(0x0A, scope.encode()))  # ScopeSpans.scope {name}

    def encode(self, traces: Iterable[tuple[int, list[SpanData]]], offset_ns: int) -> bytes:
        """``traces``: (trace id, its spans) pairs; ``offset_ns``: Unix nanoseconds minus monotonic ones."""
        spans = b"".join([_span(b"\x0a\x10" + trace_id.to_bytes(16, "big") + b"\x12\x08", span, offset_ns)
                          for trace_id, trace_spans in traces for span in trace_spans])
        scope_spans = _field(0x12, self._scope + spans)  # ResourceSpans.scope_spans
        return _field(0x0A, self._resource + scope_spans)  # ExportTraceServiceRequest.resource_spans


def readable_spans(trace_id: int, spans: list[SpanData], resource: Resource, scope: str,
                   offset_ns: int) -> list[ReadableSpan]:
    """The same spans as the SDK's objects, for the stock exporter (and to check ``Encoder`` against it)."""
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    kinds = {INTERNAL: SpanKind.INTERNAL, SERVER: SpanKind.SERVER, CLIENT: SpanKind.CLIENT}
    flags, instrumentation = TraceFlags(TraceFlags.SAMPLED), InstrumentationScope(scope)

    def ns(at: float) -> int:
        return int(at * 1e9) + offset_ns

    return [ReadableSpan(
        span.name, SpanContext(trace_id, span.span_id, False, flags),
        SpanContext(trace_id, span.parent_id, span.remote_parent, flags) if span.parent_id else None,
        resource, dict(span.attributes), tuple(Event(name, dict(values), ns(at)) for name, at, values in span.events),
        kind=kinds[span.kind], status=Status(StatusCode.ERROR if span.error else StatusCode.UNSET),
        start_time=ns(span.start), end_time=ns(span.end), instrumentation_scope=instrumentation)
        for span in spans]
