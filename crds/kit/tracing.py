"""OpenTelemetry traces for rolloutd's processes: off unless `ROLLOUTD_TRACING=1`, exported over OTLP/HTTP.

`setup(service, on)` is called once by each process (controller, node daemon) with its settings' word; the standard
`OTEL_*` variables (endpoint, headers, service name, resource attributes, sampler) are the SDK's own. With tracing off
nothing of OpenTelemetry is imported and every helper is a no-op. On, the SDK gives the resource, the sampler and the
exporter's HTTP client; the spans are crds/kit/trace_spans.py's (`Span`; the current one in this module's context
variable, with the helpers that read it: `trace_id`, `TraceIdFilter`, `context`, `attached`), ended here
(`finished`), encoded by crds/kit/otlp.py and sent by crds/kit/otlp_batches.py. Next step: `rolloutd.agents.spans`
(the node's spans) and `controller/work/tracing.py` (the controller's).
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import random
from collections.abc import Iterator
from typing import Any

from rolloutd.crds.kit.otlp import clean as _clean

TRACER = "rolloutd"

_tracer: Any = None   # an opentelemetry Tracer once `setup` turned tracing on
_provider: Any = None
_batches: Any = None  # `finished` spans' queue (crds/kit/otlp_batches.py) once one was sent; False: the provider
_follows_parent = False  # the sampler keeps a child span exactly when its parent was kept (the SDK's default)
_roots_kept = False      # the sampler keeps every new trace (the SDK's default: parent-based, root always on)


def enabled() -> bool:
    return _tracer is not None


def setup(service: str, on: bool) -> bool:
    """Make the SDK's tracer provider (resource, sampler) and the batches of spans sent by its OTLP/HTTP exporter's
    client when `on` (`ROLLOUTD_TRACING`, read by the process's settings); True when on.
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
    exporter = OTLPSpanExporter()   # the spans are encoded by crds/kit/otlp.py (~4× cheaper), sent by its client
    if not callable(getattr(getattr(exporter, "_client", None), "export", None)):
        _provider.add_span_processor(BatchSpanProcessor(exporter))   # another SDK: `finished` goes through it
    _tracer = _provider.get_tracer(TRACER)
    _batches = None
    _sampler_known()
    for handler in logging.getLogger().handlers:
        handler.addFilter(TraceIdFilter())
    return True


def use(provider: Any) -> None:
    """Trace into `provider` (an SDK TracerProvider the caller made: a test's in-memory exporter), or stop (None)."""
    global _tracer, _provider, _batches
    _provider = provider
    _tracer = provider.get_tracer(TRACER) if provider is not None else None
    _batches = False   # `finished` spans go through the provider's processors too
    if provider is not None:
        _sampler_known()


def _sampler_known() -> None:
    """Whether the provider's sampler decides a child span by its parent's flag alone (`ParentBased` with its
    default delegates, whatever its root sampler: OTEL_TRACES_SAMPLER's `parentbased_*`, the default)."""
    global _follows_parent, _roots_kept
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

    sampler = _provider.sampler
    _follows_parent = isinstance(sampler, ParentBased) and all(
        getattr(sampler, f"_{who}_parent_{kept}", None) is want for who in ("remote", "local")
        for kept, want in (("sampled", ALWAYS_ON), ("not_sampled", ALWAYS_OFF)))
    _roots_kept = sampler is ALWAYS_ON or (isinstance(sampler, ParentBased) and getattr(sampler, "_root", None) is ALWAYS_ON)


def flush() -> None:
    """Flush what is batched (a process about to exit by `os._exit` or a signal)."""
    if _batches:
        _batches.flush()
    if _provider is not None:
        with contextlib.suppress(Exception):
            _provider.force_flush(5_000)


def counts() -> str:
    """What the batches did so far (`otlp_batches.Batches.counts`), for a process's last log line."""
    return _batches.counts() if _batches else "the provider's processors"


def lost() -> int:
    """Spans dropped or not sent so far."""
    return (_batches.dropped + _batches.failed) if _batches else 0


def stopping(timeout: float = 5.0) -> None:
    """The process is stopping, its work done: from now on `finished` spans are sent by the caller's thread as their
    batches fill, none dropped for want of room (`otlp_batches.Batches.close`), for `timeout` s at most; `flush` sends
    the rest. The controller's stop ends every attempt still in flight between the two (controller/work/tracing.py)."""
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
    return _roots_kept or _provider.sampler.should_sample(None, trace_id, name).decision.is_sampled()


def traceparent_of(trace_id: int, span_id: int, is_sampled: bool = True) -> str:
    """The W3C traceparent of a span known by its ids (one `finished` will send)."""
    return f"00-{trace_id.to_bytes(16, 'big').hex()}-{span_id.to_bytes(8, 'big').hex()}-{'01' if is_sampled else '00'}"


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

    from opentelemetry.sdk.trace import Event

    flags = api.TraceFlags(api.TraceFlags.SAMPLED)
    parent = api.SpanContext(s.trace_id, s.parent_id, s.remote, flags) if s.parent_id else None
    _provider._active_span_processor.on_end(ReadableSpan(
        s.name, api.SpanContext(s.trace_id, s.span_id, False, flags), parent, _provider.resource,
        _clean(s.attributes), events=[Event(name, attrs, at) for at, name, attrs in s.events], start_time=s.start,
        end_time=s.end, instrumentation_scope=InstrumentationScope(TRACER),
        status=Status(StatusCode.ERROR, s.error[:500]) if s.error is not None else Status(StatusCode.UNSET)))


def encoded(*spans: bytes) -> bool:
    """Send spans already encoded (`otlp.encode`: the controller's, ~2× cheaper than a `Finished` encoded later);
    False when spans go through the provider's processors instead (`use`, or an SDK without the client): the
    caller sends `Finished` ones."""
    global _batches
    if _tracer is None:
        return True
    if _batches is None:
        _batches = _own_batches()
    if _batches:
        for data in spans:
            _batches.add(data)
        return True
    return False


def _own_batches() -> Any:
    """`otlp_batches.Batches` sending by the SDK exporter's HTTP client, or False (`otlp_batches.sdk_batches`)."""
    from rolloutd.crds.kit import otlp_batches

    return otlp_batches.sdk_batches(dict(_provider.resource.attributes), TRACER)


# the open span current in this task (crds/kit/trace_spans.py `Span`, or a `context()` attached), None outside any
_current: contextvars.ContextVar[Any] = contextvars.ContextVar("rolloutd_span", default=None)


def trace_id() -> str | None:
    """The current span's trace id (32 hex digits), or None."""
    s = _current.get() if _tracer is not None else None
    return format(s.trace_id, "032x") if s is not None else None


class TraceIdFilter(logging.Filter):
    """Appends `trace_id=…` to the log lines written inside a span, so a line leads to its trace."""

    def filter(self, record: logging.LogRecord) -> bool:
        tid = trace_id()
        if tid is not None and isinstance(record.msg, str) and "trace_id=" not in record.msg:
            record.msg = f"{record.msg} [trace_id={tid}]"
        return True


def context() -> Any:
    """The current span (to carry into work served by other tasks, e.g. the harness gateway), or None."""
    return _current.get() if _tracer is not None else None


@contextlib.contextmanager
def attached(ctx: Any) -> Iterator[None]:
    """Run the block with `ctx` (from `context()`) as its current span; no-op for None."""
    if ctx is None or _tracer is None:
        yield
        return
    token = _current.set(ctx)
    try:
        yield
    finally:
        _current.reset(token)
