"""Tracing: one client request is one OpenTelemetry trace across client, guard and engine.

A real OTLP/HTTP receiver (``Collector``: an aiohttp app answering ``POST /v1/traces`` and decoding each
body as the protocol's ``ExportTraceServiceRequest``) takes the spans of a real engine and a real guard,
both started as processes with ``OTEL_EXPORTER_OTLP_ENDPOINT`` pointing at it. The guard's own wire encoder
(guard/otlp.py) is also checked against the SDK's encoding of the same spans, field for field.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from support.guard_server import guard_config
from support.loop_thread import AppThread
from support.net import free_port, request
from support.processes import Processes
from support.wait import wait_for

from guard import tracing
from guard.otlp import Encoder, readable_spans

GUARD_SPANS = {"guard.validate", "guard.admission", "guard.queue", "guard.upstream", "guard.relay"}
ENGINE_SPANS = {"engine.queue", "engine.prefill", "engine.decode"}


class Collector(AppThread):
    """An OTLP/HTTP trace receiver on a loopback port: every span it was sent, with its service's name."""

    def __init__(self) -> None:
        super().__init__("test-otlp-collector")
        self.received: list[tuple[str, Span]] = []  # appended on the collector's loop, read by the test

    def make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/traces", self.traces)
        return app

    async def traces(self, http: web.Request) -> web.Response:
        assert http.content_type == "application/x-protobuf"
        export = ExportTraceServiceRequest.FromString(await http.read())
        for resource_spans in export.resource_spans:
            attributes = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                self.received += [(attributes["service.name"], span) for span in scope_spans.spans]
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def trace(self, trace_id: str) -> list[tuple[str, Span]]:
        return [(service, span) for service, span in list(self.received) if span.trace_id.hex() == trace_id]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Collector]]:
    """A collector, and an engine and a guard exporting to it; yields the guard's URL."""
    root: Path = tmp_path_factory.mktemp("tracing")
    with Collector() as collector, Processes(root) as processes:
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, "OTEL_BSP_SCHEDULE_DELAY": "50"}
        for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER"):
            env.pop(name, None)
        engine = processes.engine("--num-blocks", "128", env=env)
        guard_config(engine.url, root, listen={"host": "127.0.0.1", "port": free_port()})
        guard = processes.guard(root / "guard.yaml", env=env)
        yield guard.url, collector


def _send(url: str, traceparent: str | None, stream: bool) -> bytes:
    body = {"model": "tiny", "prompt": "tracing across the stack", "max_tokens": 4, "stream": stream}
    headers = {"Authorization": "Bearer sk-acme", **({"traceparent": traceparent} if traceparent else {})}
    status, answer = request(url + "/v1/completions", json.dumps(body).encode(), headers)
    assert status == 200, answer
    return answer


def _complete_trace(collector: Collector, trace_id: str) -> dict[bytes, tuple[str, Span]]:
    """The trace's spans by id, once both sides' spans have all arrived."""
    def names(spans: list[tuple[str, Span]]) -> set[str]:
        return {span.name for _, span in spans}

    spans = wait_for(lambda: collector.trace(trace_id),
                     lambda s: GUARD_SPANS | ENGINE_SPANS <= names(s) and len([1 for _, x in s
                                                                               if x.kind == Span.SPAN_KIND_SERVER]) == 2,
                     timeout=15, message=lambda: f"spans so far: {sorted(names(collector.trace(trace_id)))}")
    return {span.span_id: (service, span) for service, span in spans}


def _ancestors(spans: dict[bytes, tuple[str, Span]], span: Span) -> list[bytes]:
    chain = []
    while span.parent_span_id:
        chain.append(span.parent_span_id)
        if span.parent_span_id not in spans:
            break
        span = spans[span.parent_span_id][1]
    return chain


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_one_request_is_one_trace_across_client_guard_and_engine(stack: tuple[str, Collector], stream: bool):
    url, collector = stack
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8)
    answer = _send(url, f"00-{trace_id}-{client_span.hex()}-01", stream)
    assert answer.endswith(b"data: [DONE]\n\n") if stream else json.loads(answer)["choices"]
    spans = _complete_trace(collector, trace_id)

    guard = {span.name: span for service, span in spans.values() if service == "kvguard-guard"}
    engine = [span for service, span in spans.values() if service == "kvguard-engine"]
    assert {service for service, _ in spans.values()} == {"kvguard-guard", "kvguard-engine"}
    assert GUARD_SPANS <= set(guard) and ENGINE_SPANS <= {span.name for span in engine}
    root = guard["POST /v1/completions"]
    assert root.kind == Span.SPAN_KIND_SERVER and root.parent_span_id == client_span
    assert all(client_span in _ancestors(spans, span) for span in guard.values())
    upstream = guard["guard.upstream"]
    assert upstream.kind == Span.SPAN_KIND_CLIENT
    (server,) = [span for span in engine if span.kind == Span.SPAN_KIND_SERVER]
    assert server.parent_span_id == upstream.span_id  # the engine continued the guard's traceparent
    assert all(upstream.span_id in _ancestors(spans, span) for span in engine)
    assert guard["guard.queue"].parent_span_id == guard["guard.admission"].span_id
    for span in spans.values():  # no span ends before it starts, children inside the request's root
        assert span[1].start_time_unix_nano <= span[1].end_time_unix_nano
    assert "first_token" in {event.name for event in server.events}
    if stream:  # the guard sees tokens only in a stream: its TTFT is the upstream span's event
        (ttft,) = [event for event in upstream.events if event.name == "first_token"]
        assert upstream.start_time_unix_nano < ttft.time_unix_nano <= upstream.end_time_unix_nano


def test_a_request_without_traceparent_starts_its_trace_at_the_guard(stack: tuple[str, Collector]):
    url, collector = stack
    before = len(collector.received)
    _send(url, None, stream=False)
    roots = wait_for(lambda: [s for service, s in collector.received[before:]
                              if service == "kvguard-guard" and s.kind == Span.SPAN_KIND_SERVER],
                     lambda found: len(found) == 1, timeout=15)
    assert not roots[0].parent_span_id
    _complete_trace(collector, roots[0].trace_id.hex())


def test_the_guards_encoder_writes_what_the_sdk_encoder_writes():
    trace = tracing.begin({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}, "POST",
                          "/v1/chat/completions", 100.0)
    for stage, at in {"validated": 100.001, "admission": 100.002, "queued": 100.003, "admitted": 100.004,
                      "upstream": 100.005, "headers": 100.006, "first_token": 100.007, "upstream_end": 100.01,
                      "ended": 100.011}.items():
        setattr(trace, stage, at)
    trace.unavailable = ((100.0045, "e1"),)
    trace.backend, trace.upstream_status, trace.status, trace.tenant = "e0", 200, 503, "acme"
    trace.outcome, trace.request_id, trace.token_events, trace.blocks, trace.waited = "completed", "req-1", 3, 2, True
    spans, resource = trace.spans(), tracing.resource()
    assert len(spans) == 6
    offset = time.time_ns() - time.monotonic_ns()
    ours = Encoder(dict(resource.attributes), tracing.SCOPE).encode([(trace.trace_id, spans)], offset)
    sdk = encode_spans(readable_spans(trace.trace_id, spans, resource, tracing.SCOPE, offset))
    assert ExportTraceServiceRequest.FromString(ours) == sdk


def test_an_unsampled_client_trace_is_passed_on_untouched_and_not_recorded():
    header = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    trace = tracing.begin({"traceparent": header, "tracestate": "k=v"}, "POST", "/v1/completions", 1.0)
    assert not trace.sampled
    assert trace.upstream_headers() == {"traceparent": header, "tracestate": "k=v"}
    for bad in ("", "00-" + "0" * 32 + "-b7ad6b7169203331-01", "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01"):
        fresh = tracing.begin({"traceparent": bad}, "POST", "/v1/completions", 1.0)
        assert fresh.sampled and fresh.parent_id == 0  # an invalid header starts a new trace


def test_without_an_endpoint_nothing_is_set_up(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    tracing.setup()
    assert not tracing.ENABLED and tracing._provider is None


def test_the_engine_thread_notes_prompt_chunks_and_preemptions_not_decodes():
    from engine.sampling_params import SamplingParams
    from engine.sched.output import SchedulerOutput
    from engine.sched.request import Request, SeqStatus, Sequence
    from engine.server.tracing import Timeline, record_step

    request = Request("r", None, [1] * 20, SamplingParams(max_tokens=4), 4)
    seq = Sequence(0, request, 0, [1] * 20, 20)
    request.seqs.append(seq)
    timelines = {"r": Timeline()}
    # As the scheduler leaves a sequence after each step: its computed tokens already committed.
    for (computed, new, samples), step in zip([(16, 16, 0), (20, 4, 1), (21, 1, 1)], range(1, 4), strict=True):
        seq.num_computed_tokens = computed
        seq.token_ids += [5] * samples
        record_step(timelines, SchedulerOutput(seqs=[seq], num_new_tokens=[new]), step, step + 0.5)
    seq.status = SeqStatus.SWAPPED
    record_step(timelines, SchedulerOutput(preempted=[seq]), 4.0, 4.5)
    timeline = timelines["r"]
    assert (timeline.scheduled, timeline.last) == (1, 3.5)
    assert timeline.prefills == [(1, 1.5, 0, 16), (2, 2.5, 16, 4)]  # the decode step is no prefill
    assert timeline.preemptions == [(4.0, "swap", 0)]
    seq.status, seq.finish_reason = SeqStatus.FINISHED, "length"
    record_step(timelines, SchedulerOutput(seqs=[seq], num_new_tokens=[1]), 5.0, 5.5)
    assert timelines == {}  # a finished request is forgotten by the engine thread
