"""OpenTelemetry traces for rolloutd's processes: off unless `ROLLOUTD_TRACING=1`, exported over OTLP/HTTP.

`setup(service, on)` is called once by each process (controller, node daemon) with its settings' word; the standard `OTEL_*` variables
(endpoint, headers, service name, resource attributes, sampler) are the SDK's own. With tracing off nothing of
OpenTelemetry is imported and every helper is a no-op. Next step: `rolloutd.agents.spans` (the node's spans)
and `controller/work/tracing.py` (the controller's).
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
from collections.abc import Iterator
from typing import Any

TRACER = "rolloutd"

_tracer: Any = None   # an opentelemetry Tracer once `setup` turned tracing on
_provider: Any = None
_batches: Any = None  # `finished` spans' queue (crds/kit/otlp.py) once one was sent; False: through the provider


def enabled() -> bool:
    return _tracer is not None


def setup(service: str, on: bool) -> bool:
    """Install the SDK's tracer provider with an OTLP/HTTP exporter (batched) when `on` (`ROLLOUTD_TRACING`, read
    by the process's settings); True when on.
    `OTEL_SERVICE_NAME` overrides `service`. Raises ImportError naming the extra when the SDK is missing."""
    global _tracer, _batches
    if _tracer is not None or not on:
        return _tracer is not None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as e:
        raise ImportError(f"ROLLOUTD_TRACING is set but OpenTelemetry is not installed: pip install 'rolloutd[tracing]' "
                          f"({e})") from e
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service})
    # flushed and shut down at exit (the SDK's atexit hook). Not made the global provider: libraries that trace
    # whatever a global provider is set (FastAPI 0.165 traces every request) would bury the rollouts' traces.
    global _provider
    _provider = TracerProvider(resource=resource)
    from rolloutd.crds.kit import otlp

    exporter = OTLPSpanExporter()   # its spans encoded by crds/kit/otlp.py (~4× cheaper), sent by its client
    _provider.add_span_processor(BatchSpanProcessor(otlp.sdk_exporter(exporter) or exporter))
    _tracer = _provider.get_tracer(TRACER)
    _batches = None
    for handler in logging.getLogger().handlers:
        handler.addFilter(TraceIdFilter())
    return True


def use(provider: Any) -> None:
    """Trace into `provider` (an SDK TracerProvider the caller made: a test's in-memory exporter), or stop (None)."""
    global _tracer, _provider, _batches
    _provider = provider
    _tracer = provider.get_tracer(TRACER) if provider is not None else None
    _batches = False   # `finished` spans go through the provider's processors too


def flush() -> None:
    """Flush what is batched (a process about to exit by `os._exit` or a signal)."""
    if _batches:
        _batches.flush()
    if _provider is not None:
        with contextlib.suppress(Exception):
            _provider.force_flush(5_000)


def stopping(timeout: float = 5.0) -> None:
    """The process is stopping, its work done: from now on `finished` spans are sent by the caller's thread as their
    batches fill, none dropped for want of room (`otlp.Batches.close`), for `timeout` s at most; `flush` sends the
    rest. The controller's stop ends every attempt still in flight between the two (controller/work/tracing.py)."""
    global _batches
    if _tracer is None:
        return
    if _batches is None:
        _batches = _own_batches()
    if _batches:
        _batches.close(timeout)


def new_ids() -> tuple[int, int]:
    """A new trace id and span id (random, as the SDK's default id generator makes them)."""
    return random.getrandbits(128) or 1, random.getrandbits(64) or 1


def sampled(trace_id: int, name: str) -> bool:
    """Whether the provider's sampler (`OTEL_TRACES_SAMPLER`, `…_ARG`) keeps a new trace `trace_id` rooted in `name`."""
    if _tracer is None:
        return False
    return _provider.sampler.should_sample(None, trace_id, name).decision.is_sampled()


def traceparent_of(trace_id: int, span_id: int, is_sampled: bool = True) -> str:
    """The W3C traceparent of a span known by its ids (one `finished` will send)."""
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if is_sampled else '00'}"


def finished(s: Any) -> None:
    """Send a span that has ended, given as plain values (`otlp.Finished`: the controller builds its spans of an
    attempt only when the attempt ends, ~5× cheaper than the SDK's spans). Through the provider's processors when
    the provider is the caller's (`use`) or its exporter offers no client to send encoded bytes by."""
    global _batches
    if _tracer is None or not s.sampled:
        return
    if _batches is None:
        _batches = _own_batches()
    if _batches:
        _batches.add(s)
        return
    from opentelemetry import trace as api
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import Status, StatusCode

    flags = api.TraceFlags(api.TraceFlags.SAMPLED)
    parent = api.SpanContext(s.trace_id, s.parent_id, False, flags) if s.parent_id else None
    _provider._active_span_processor.on_end(ReadableSpan(
        s.name, api.SpanContext(s.trace_id, s.span_id, False, flags), parent, _provider.resource,
        _clean(s.attributes), start_time=s.start, end_time=s.end, instrumentation_scope=InstrumentationScope(TRACER),
        status=Status(StatusCode.ERROR, s.error[:500]) if s.error is not None else Status(StatusCode.UNSET)))


def _own_batches() -> Any:
    """`otlp.Batches` sending by the SDK exporter's HTTP client (the standard OTLP variables), or False when
    this SDK's exporter has none (another version)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from rolloutd.crds.kit import otlp

    client = getattr(OTLPSpanExporter(), "_client", None)
    if client is None or not callable(getattr(client, "export", None)):
        return False
    def send(data: bytes, timeout: float | None) -> bool:
        if timeout is not None and isinstance(getattr(client, "_timeout", None), (int, float)):
            client._timeout = min(client._timeout, max(timeout, 0.05))   # a stop's sends: within its time left
        return bool(client.export(data).success)

    batches = otlp.Batches(send, dict(_provider.resource.attributes), TRACER)
    atexit.register(batches.shutdown)
    return batches


class _Nothing:
    """The span of a process without tracing: takes every call and does nothing."""

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        pass

    def set_status_error(self, description: str) -> None:
        pass

    def end(self, end_time: int | None = None) -> None:
        pass


NOTHING = _Nothing()


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    """OTLP attribute values: str, bool, int, float or their lists; None dropped, anything else as str."""
    out: dict[str, Any] = {}
    for k, v in attributes.items():
        if v is None:
            continue
        if isinstance(v, (str, bool, int, float)):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (str, bool, int, float)) for x in v):
            out[k] = list(v)
        else:
            out[k] = str(v)
    return out


@contextlib.contextmanager
def span(name: str, attributes: dict[str, Any] | None = None, *, start_time: int | None = None,
         parent: str | None = None) -> Iterator[Any]:
    """A span around the block, the current one inside it (child of `parent`, a W3C traceparent, when given,
    else of the current span). An exception escaping the block marks it as an error. No-op with tracing off."""
    if _tracer is None:
        yield NOTHING
        return
    from opentelemetry import context as otel_context
    from opentelemetry.trace import Status, StatusCode, set_span_in_context

    ctx = extract(parent) if parent else None
    # what `start_as_current_span` does, without its three nested context managers (~20 % of a span's cost)
    s = _tracer.start_span(name, context=ctx, attributes=_clean(attributes or {}), start_time=start_time)
    token = otel_context.attach(set_span_in_context(s))
    try:
        yield s
    except Exception as e:   # as `use_span`: not GeneratorExit, not a cancellation
        if s.is_recording():
            s.record_exception(e)
            s.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
        raise
    finally:
        otel_context.detach(token)
        s.end()


def start(name: str, attributes: dict[str, Any] | None = None, *, start_time: int | None = None,
          parent: Any = None) -> Any:
    """A span not made current (ended by the caller's `end()`), child of `parent` (a span) or a new trace."""
    if _tracer is None:
        return NOTHING
    from opentelemetry import trace

    ctx = trace.set_span_in_context(parent) if parent is not None else None
    return _tracer.start_span(name, context=ctx, attributes=_clean(attributes or {}), start_time=start_time)


def set_attributes(s: Any, attributes: dict[str, Any]) -> None:
    if s is not NOTHING:
        s.set_attributes(_clean(attributes))


def error(s: Any, description: str) -> None:
    """Mark `s` as failed with `description` (an infra or config failure, never a low reward)."""
    if s is not NOTHING:
        from opentelemetry.trace import Status, StatusCode

        s.set_status(Status(StatusCode.ERROR, description[:500]))


def traceparent(s: Any = None) -> str | None:
    """The W3C traceparent of `s` (default the current span), for another process; None with tracing off."""
    if _tracer is None:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(s) if s is not None else None
    TraceContextTextMapPropagator().inject(carrier, context=ctx)
    return carrier.get("traceparent")


def extract(value: str) -> Any:
    """The context a W3C traceparent names (a malformed one gives a new trace: it is the peer's word)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": value})


def trace_id() -> str | None:
    """The current span's trace id (32 hex digits), or None."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    sc = trace.get_current_span().get_span_context()
    return format(sc.trace_id, "032x") if sc.is_valid else None


class TraceIdFilter(logging.Filter):
    """Appends `trace_id=…` to the log lines written inside a span, so a line leads to its trace."""

    def filter(self, record: logging.LogRecord) -> bool:
        tid = trace_id()
        if tid is not None and isinstance(record.msg, str) and "trace_id=" not in record.msg:
            record.msg = f"{record.msg} [trace_id={tid}]"
        return True


def context() -> Any:
    """The current trace context (to carry into work served by other tasks, e.g. the harness gateway)."""
    if _tracer is None:
        return None
    from opentelemetry import context as otel_context

    return otel_context.get_current()


@contextlib.contextmanager
def attached(ctx: Any) -> Iterator[None]:
    """Run the block in the trace context `ctx` (from `context()`); no-op for None."""
    if ctx is None or _tracer is None:
        yield
        return
    from opentelemetry import context as otel_context

    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)
