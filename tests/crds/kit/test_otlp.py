"""The controller's spans encoded by crds/kit/otlp.py decode, with the official OTLP protobuf classes, to the very
messages the SDK's own encoder makes of the same spans; and the controller's attempt spans, sent through a real
tracer provider, keep their ids, parent link, times, attributes and error status."""
from __future__ import annotations

import pytest
from opentelemetry import trace as api
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Status, StatusCode

from rolloutd.controller.work import tracing as attempt_traces
from rolloutd.crds.kit import otlp, tracing
from rolloutd.crds.node import Lease

ATTRS = {"rolloutd.attempt.id": "3.1.abcdef", "rolloutd.item": 3, "rolloutd.reward": 0.5, "rolloutd.ok": True,
         "rolloutd.negative": -7, "gen_ai.response.finish_reasons": ["stop", "length"], "rolloutd.unicode": "é ✓",
         "rolloutd.big": 2**62}


def _sdk(s: otlp.Finished, resource: Resource) -> ReadableSpan:
    flags = api.TraceFlags(api.TraceFlags.SAMPLED)
    parent = api.SpanContext(s.trace_id, s.parent_id, False, flags) if s.parent_id else None
    return ReadableSpan(s.name, api.SpanContext(s.trace_id, s.span_id, False, flags), parent, resource, s.attributes,
                        start_time=s.start, end_time=s.end, instrumentation_scope=InstrumentationScope("rolloutd"),
                        status=Status(StatusCode.ERROR, s.error) if s.error else Status(StatusCode.UNSET))


def test_encoded_spans_equal_the_sdk_encoders():
    resource = Resource.create({"service.name": "rolloutd-controller"})
    spans = [otlp.Finished("rollout", 2**127 + 5, 2**63 + 9, 0, 1_700_000_000_000_000_000, 1_700_000_001_000_000_000,
                           ATTRS, "lease expired"),
             otlp.Finished("queue", 2**127 + 5, 77, 2**63 + 9, 1_700_000_000_000_000_000, 1_700_000_000_500_000_000,
                           {"rolloutd.queue.seconds": 0.5})]
    ours = ExportTraceServiceRequest.FromString(otlp.request(dict(resource.attributes), "rolloutd", spans))
    theirs = ExportTraceServiceRequest.FromString(encode_spans([_sdk(s, resource) for s in spans]).SerializeToString())
    assert ours == theirs
    assert ours.resource_spans[0].scope_spans[0].spans[1].parent_span_id == (2**63 + 9).to_bytes(8, "big")


def test_attempt_spans_through_a_provider_keep_ids_links_and_attributes():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    try:
        lease = Lease(attempt_id="4.2.abcdef", item=4, prompt=1, sample=3, attempt=2, task={},
                      backend="http://b:1", queued_seconds=0.25)
        tp = attempt_traces.granted(lease, "team/job", "node-7")
        tid = attempt_traces.trace_id(lease.attempt_id)
        assert tp.startswith(f"00-{tid}-") and tp.endswith("-01")
        assert exporter.get_finished_spans() == ()        # nothing is built before the attempt ends
        attempt_traces.ended(lease.attempt_id, "expired")
        assert attempt_traces.trace_id(lease.attempt_id) is None
        queue, root = exporter.get_finished_spans()
    finally:
        tracing.use(None)
    assert (queue.name, root.name) == ("queue", "rollout")
    assert format(root.context.trace_id, "032x") == tid and tp.split("-")[2] == format(root.context.span_id, "016x")
    assert root.parent is None and queue.parent.span_id == root.context.span_id
    assert queue.context.trace_id == root.context.trace_id
    assert queue.start_time == root.start_time and queue.end_time <= root.end_time
    assert (queue.end_time - queue.start_time) / 1e9 == pytest.approx(0.25, abs=1e-6)
    assert dict(root.attributes) == {
        "rolloutd.attempt.id": "4.2.abcdef", "rolloutd.rollout.id": "team/job#4", "rolloutd.job": "job",
        "rolloutd.namespace": "team", "rolloutd.item": 4, "rolloutd.prompt": 1, "rolloutd.sample": 3,
        "rolloutd.attempt": 2, "rolloutd.node": "node-7", "rolloutd.backend": "http://b:1",
        "rolloutd.outcome": "expired"}
    assert root.status.status_code == StatusCode.ERROR and root.status.description == "lease expired"


def test_a_trace_the_sampler_drops_is_not_kept_and_says_so():
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    try:
        lease = Lease(attempt_id="5.1.abcdef", item=5, prompt=0, sample=0, attempt=1, task={}, backend=None)
        tp = attempt_traces.granted(lease, "default/j", "n")
        assert tp.endswith("-00") and attempt_traces.trace_id(lease.attempt_id) is None
        attempt_traces.ended(lease.attempt_id, "done")
    finally:
        tracing.use(None)
    assert exporter.get_finished_spans() == ()


def test_the_node_exporter_sends_every_span_as_the_sdk_encoder_would():
    """The node daemon's exporter: plain spans encoded here, the rest (an exception's event) by the SDK, in one request
    whose spans are the SDK encoder's, remote parent (the lease's traceparent) flagged as it flags it."""
    sent: list[bytes] = []

    class Client:
        def export(self, data: bytes):
            sent.append(data)
            return type("R", (), {"success": True})()

    class Wrapped:
        _client = Client()

        def shutdown(self) -> None:
            pass

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "rolloutd-node"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.use(provider)
    try:
        with tracing.span("node.attempt", ATTRS, parent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"):
            with tracing.span("RUN", {"rolloutd.stage": "run"}):
                try:
                    with tracing.span("execute_tool bash", {"gen_ai.tool.name": "bash"}):
                        raise ValueError("boom")
                except ValueError:
                    pass
    finally:
        tracing.use(None)
    spans = memory.get_finished_spans()
    assert len(spans) == 3 and any(s.events for s in spans)
    exporter = otlp.sdk_exporter(Wrapped())
    assert exporter.export(spans).name == "SUCCESS"
    ours = ExportTraceServiceRequest.FromString(sent[0])
    theirs = ExportTraceServiceRequest.FromString(encode_spans(spans).SerializeToString())
    flat = lambda req: sorted((s.SerializeToString(deterministic=True) for rs in req.resource_spans  # noqa: E731
                               for ss in rs.scope_spans for s in ss.spans))
    assert flat(ours) == flat(theirs)
    assert {rs.resource.SerializeToString(deterministic=True) for rs in ours.resource_spans} == \
        {theirs.resource_spans[0].resource.SerializeToString(deterministic=True)}
    node = next(s for rs in ours.resource_spans for ss in rs.scope_spans for s in ss.spans if s.name == "node.attempt")
    assert node.flags == 0x300 and node.parent_span_id.hex() == "b7ad6b7169203331"


def _batches(send, monkeypatch, batch: int = 100, most: int = 200) -> otlp.Batches:
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", str(batch))
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", str(most))
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    return otlp.Batches(send, {"service.name": "t"}, "rolloutd")


def _span(i: int) -> otlp.Finished:
    return otlp.Finished("rollout", i + 1, i + 1, 0, 1, 2, {"rolloutd.item": i})


def _count(data: bytes) -> int:
    return sum(len(ss.spans) for rs in ExportTraceServiceRequest.FromString(data).resource_spans
               for ss in rs.scope_spans)


def test_a_closing_batcher_sends_every_span_from_the_callers_thread(monkeypatch):
    """A stop: what was queued goes out, then the spans added after `close` (more than the queue holds: a controller
    ends every attempt in flight at once) are sent by the caller's thread as batches fill, none dropped."""
    import threading

    sent: list[tuple[int, str]] = []
    b = _batches(lambda data, _: sent.append((_count(data), threading.current_thread().name)) or True, monkeypatch)
    for i in range(150):
        b.add(_span(i))
    b.close()
    assert sum(n for n, _ in sent) == 150   # the thread sent what was queued before it stopped
    for i in range(150, 1150):               # 5× the queue's room
        b.add(_span(i))
    assert {who for _, who in sent[-10:]} == {threading.current_thread().name} and len(b._queue) < 100
    b.flush()
    assert sum(n for n, _ in sent) == 1150 and b.dropped == 0 and not b._queue


def test_a_closing_batcher_gives_up_at_the_first_failed_send(monkeypatch):
    """The trace backend down at a stop: one send is tried (each may wait the exporter's timeout), the rest counted
    as dropped, and the stop goes on."""
    tries: list[int] = []
    b = _batches(lambda data, _: tries.append(_count(data)) or False, monkeypatch)
    b.close()
    for i in range(1000):
        b.add(_span(i))
    b.shutdown()
    assert tries == [100] and b.dropped == 900 and b.failed == 100 and b.sent == 0
