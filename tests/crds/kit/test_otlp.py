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
from rolloutd.crds.kit import otlp, otlp_batches, trace_spans, tracing
from rolloutd.crds.node import Lease
from rolloutd.crds.trajectory import Trajectory

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
        grant = dict(attempt_id="4.2.abcdef", item=4, prompt=1, sample=3, attempt=2, backend="http://b:1",
                     queued_seconds=0.25)
        lease = Lease(**grant, task={}, traceparent=attempt_traces.granted(grant, "team/job", "node-7"))
        tp = lease.traceparent
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


def test_the_controllers_spans_encoded_at_the_end_are_those_a_provider_gets(monkeypatch):
    """The controller encodes an attempt's two spans itself when it sends them (the attributes shared with other
    attempts encoded once); decoded, they are the very spans the SDK's encoder makes of what a provider gets."""
    memory, sent = InMemorySpanExporter(), []
    provider = TracerProvider(resource=Resource.create({"service.name": "rolloutd-controller"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.use(provider)
    done = Trajectory(job="j", prompt=1, sample=3, reward=0.5, finish_reason="length")
    infra = Trajectory(job="j", prompt=1, sample=3, failure={"kind": "infra", "reason": "sandbox died"})
    try:
        for path in ("provider", "encoded"):
            if path == "encoded":
                monkeypatch.setattr(tracing, "encoded", lambda *spans: sent.extend(spans) or True)
            monkeypatch.setattr(tracing, "new_ids", lambda: (2**127 + 5, 2**63 + 9))
            monkeypatch.setattr(attempt_traces.random, "getrandbits", lambda n: 77)
            monkeypatch.setattr(attempt_traces.time, "time_ns", lambda: 1_700_000_001_000_000_000)
            for aid, outcome, t in (("4.2.abcdef", "done", done), ("5.1.abcdef", "expired", None),
                                    ("6.1.abcdef", "queued", infra)):
                attempt_traces.granted(dict(attempt_id=aid, item=4, prompt=1, sample=3, attempt=2,
                                            backend="http://b:1", queued_seconds=0.25), "team/job", "node-7")
                attempt_traces.ended(aid, outcome, t)
    finally:
        tracing.use(None)
    theirs = ExportTraceServiceRequest.FromString(encode_spans(memory.get_finished_spans()).SerializeToString())
    ours = ExportTraceServiceRequest.FromString(otlp.request(dict(provider.resource.attributes), "rolloutd", sent))
    assert len(sent) == 6 and ours == theirs
    roots = [s for s in ours.resource_spans[0].scope_spans[0].spans if s.name == "rollout"]
    assert [len(r.attributes) for r in roots] == [14, 11, 12]   # no reward, no finish reason: none sent
    assert [r.status.message for r in roots] == ["", "lease expired", "sandbox died"]


def test_a_trace_the_sampler_drops_is_not_kept_and_says_so():
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    try:
        tp = attempt_traces.granted(dict(attempt_id="5.1.abcdef", item=5, prompt=0, sample=0, attempt=1, backend=None,
                                         queued_seconds=0.0), "default/j", "n")
        assert tp.endswith("-00") and attempt_traces.trace_id("5.1.abcdef") is None
        attempt_traces.ended("5.1.abcdef", "done")
    finally:
        tracing.use(None)
    assert exporter.get_finished_spans() == ()


def _block(span, error) -> None:
    """A node's attempt as agents/spans.py traces it: a remote parent, stages, attributes set later (one set again),
    an error status, an exception escaping a span, a span that is not current."""
    with span("node.attempt", ATTRS, parent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01") as node:
        with span("RUN", {"rolloutd.stage": "run", "rolloutd.none": None}):
            with span("turn", {"rolloutd.turn": 0}) as turn:
                turn.set_attributes({"rolloutd.item": 9, "gen_ai.usage.output_tokens": 12, "rolloutd.reward": 0.25})
                try:
                    with span("execute_tool bash", {"gen_ai.tool.name": "bash"}):
                        raise ValueError("boom")
                except ValueError:
                    pass
        error(node, "sandbox died")


def test_the_node_spans_are_the_sdks_spans_of_the_same_block(monkeypatch):
    """The node daemon's spans (`trace_spans.Span`, encoded by otlp.py) decode to what the SDK's spans of the same
    block encode to with the SDK's encoder: names, parent links (the remote one flagged), attributes in order, status,
    the exception's event; only ids, times and the traceback's lines differ."""
    import contextlib

    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "rolloutd-node"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    sdk = provider.get_tracer("rolloutd")

    @contextlib.contextmanager
    def sdk_span(name, attributes, parent=None):   # what tracing.span did with the SDK (3017822)
        from opentelemetry import context as otel_context
        ctx = TraceContextTextMapPropagator().extract({"traceparent": parent}) if parent else None
        s = sdk.start_span(name, context=ctx, attributes=otlp.clean(attributes))
        token = otel_context.attach(set_span_in_context(s))
        try:
            yield s
        except Exception as e:
            s.record_exception(e)
            s.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
            raise
        finally:
            otel_context.detach(token)
            s.end()

    _block(sdk_span, lambda s, d: s.set_status(Status(StatusCode.ERROR, d)))
    theirs = ExportTraceServiceRequest.FromString(encode_spans(memory.get_finished_spans()).SerializeToString())
    ours_spans: list[otlp.Finished] = []
    tracing.use(provider)
    monkeypatch.setattr(tracing, "finished", ours_spans.append)
    try:
        _block(trace_spans.span, trace_spans.error)
    finally:
        tracing.use(None)
    ours = ExportTraceServiceRequest.FromString(otlp.request(dict(provider.resource.attributes), "rolloutd", ours_spans))

    def plain(req) -> list:
        """Each span in end order, its ids replaced by its name's, times zeroed, tracebacks cut to their last line."""
        spans = [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
        names = {s.span_id: s.name.encode() for s in spans}
        for s in spans:
            assert s.trace_id.hex() == "0af7651916cd43dd8448eb211c80319c" and s.end_time_unix_nano >= s.start_time_unix_nano
            s.span_id, s.parent_span_id = names[s.span_id], names.get(s.parent_span_id, s.parent_span_id)
            s.trace_id, s.start_time_unix_nano, s.end_time_unix_nano = b"", 0, 0
            for e in s.events:
                e.time_unix_nano = 0
                for a in e.attributes:
                    if a.key == "exception.stacktrace":
                        a.value.string_value = a.value.string_value.strip().splitlines()[-1]
        return spans

    assert [rs.resource for rs in ours.resource_spans] == [rs.resource for rs in theirs.resource_spans]
    assert [ss.scope for rs in ours.resource_spans for ss in rs.scope_spans] == \
        [ss.scope for rs in theirs.resource_spans for ss in rs.scope_spans]
    mine, sdks = plain(ours), plain(theirs)
    assert [s.name for s in mine] == ["execute_tool bash", "turn", "RUN", "node.attempt"]
    assert mine == sdks
    node = mine[-1]
    assert node.flags == 0x300 and node.parent_span_id.hex() == "b7ad6b7169203331"
    assert mine[0].events[0].name == "exception" and mine[0].status.message == "ValueError: boom"


def test_spans_follow_the_sampler_and_carry_their_context(monkeypatch):
    """A parent's flag decides (the default sampler, parent-based): an unsampled lease's attempt sends nothing but
    still gives its children its trace; a root follows the root sampler; the log filter and `traceparent` see the
    current span; the gateway's `attached` makes a span current in another task's context."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

    sent: list[otlp.Finished] = []
    tracing.use(TracerProvider(sampler=ParentBased(ALWAYS_OFF)))
    monkeypatch.setattr(tracing, "finished", sent.append)
    try:
        with trace_spans.span("root") as root:   # the root sampler: off
            assert not root.is_recording() and tracing.trace_id() == format(root.trace_id, "032x")
        with trace_spans.span("node.attempt", parent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00") as off:
            with trace_spans.span("RUN") as run:
                assert run.trace_id == off.trace_id == 0x0af7651916cd43dd8448eb211c80319c and not run.sampled
                assert trace_spans.traceparent().endswith(f"-{run.span_id:016x}-00")
        with trace_spans.span("node.attempt", parent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01") as on:
            held = tracing.context()
        assert tracing.context() is None
        with tracing.attached(held), trace_spans.span("gateway GET /v1/models"):
            pass
        with trace_spans.span("bad", parent="00-" + "0" * 32 + "-b7ad6b7169203331-01") as bad:   # malformed: new trace
            assert bad.parent_id == 0
    finally:
        tracing.use(None)
    assert [(s.name, s.parent_id == on.span_id) for s in sent] == [("node.attempt", False),
                                                                     ("gateway GET /v1/models", True)]
    assert sent[0].remote and sent[0].parent_id == 0xb7ad6b7169203331 and not sent[1].remote


def _batches(send, monkeypatch, batch: int = 100, most: int = 200) -> otlp_batches.Batches:
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", str(batch))
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", str(most))
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")
    return otlp_batches.Batches(send, {"service.name": "t"}, "rolloutd")


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


def test_the_exporter_keeps_requests_where_its_environment_matters(monkeypatch):
    """The SDK's urllib3 transport (half the CPU per request) unless a proxy variable applies to the endpoint,
    which only the default `requests` transport honours; spans sent gzipped through it reach a real receiver."""
    from support.otlp_sink import OtlpSink

    for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "all_proxy",
              "no_proxy"):
        monkeypatch.delenv(k, raising=False)
    sink = OtlpSink()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"{sink.url}/v1/traces")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip")
        assert type(otlp_batches.sdk_exporter()._client._transport).__name__ == "Urllib3HTTPTransport"
        batches = otlp_batches.sdk_batches({"service.name": "t"}, "rolloutd")
        for i in range(3):
            batches.add(_span(i))
        batches.shutdown()
        assert sorted(s["attributes"]["rolloutd.item"] for s in sink.stored()) == [0, 1, 2]
        monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
        assert type(otlp_batches.sdk_exporter()._client._transport).__name__ == "RequestsHTTPTransport"
        monkeypatch.setenv("no_proxy", "127.0.0.1")
        assert type(otlp_batches.sdk_exporter()._client._transport).__name__ == "Urllib3HTTPTransport"
    finally:
        sink.close()
