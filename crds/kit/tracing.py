"""OpenTelemetry traces for rolloutd's processes: off unless `ROLLOUTD_TRACING=1`, exported over OTLP/HTTP.

`setup(service, on)` is called once by each process (controller, node daemon) with its settings' word; the standard `OTEL_*` variables
(endpoint, headers, service name, resource attributes, sampler) are the SDK's own. With tracing off nothing of
OpenTelemetry is imported and every helper is a no-op. On, the SDK gives the resource, the sampler and the exporter's
HTTP client; the spans are this module's (`Span`, the current one in a context variable) and are encoded by
crds/kit/otlp.py. Next step: `rolloutd.agents.spans` (the node's spans) and `controller/work/tracing.py` (the controller's).
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import random
import time
from collections.abc import Iterator
from typing import Any

from rolloutd.crds.kit.otlp import clean as _clean
from rolloutd.crds.kit.otlp import parse_traceparent as _parse

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


class _Nothing:
    """The span of a process without tracing: takes every call and does nothing."""

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        pass

    def set_status_error(self, description: str) -> None:
        pass

    def is_recording(self) -> bool:
        return False

    def end(self, end_time: int | None = None) -> None:
        pass


NOTHING = _Nothing()


class Span:
    """A span of this process while it is open: plain values, sent as one `otlp.Finished` when it ends (what the
    SDK's span would have sent, field for field: tests/crds/kit/test_otlp.py), at a fraction of its cost: the SDK
    checks every attribute into a locked `BoundedAttributes`, holds a lock per span and runs its processors' hooks
    (~60 µs a span on the node daemon, `bench tracing_scale`). Not sampled: ids for its children, nothing sent."""
    __slots__ = ("name", "trace_id", "span_id", "parent_id", "remote", "sampled", "start", "attributes", "error",
                 "events", "ended")

    def __init__(self, name: str, trace_id: int, span_id: int, parent_id: int, remote: bool, sampled: bool,
                 start: int, attributes: dict[str, Any]) -> None:
        self.name, self.trace_id, self.span_id, self.parent_id = name, trace_id, span_id, parent_id
        self.remote, self.sampled, self.start, self.attributes = remote, sampled, start, attributes
        self.error: str | None = None
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.ended = False

    def is_recording(self) -> bool:
        return self.sampled and not self.ended

    def set_attribute(self, key: str, value: Any) -> None:
        self.set_attributes({key: value})

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        if self.sampled and not self.ended:
            own = self.attributes
            for k, v in _clean(attributes).items():
                own.pop(k, None)   # a key set again moves last, as in the SDK's attributes
                own[k] = v

    def set_status_error(self, description: str) -> None:
        if self.sampled and not self.ended:
            self.error = description

    def record_exception(self, e: BaseException) -> None:
        """The SDK's `record_exception`: an `exception` event with its type, message and traceback."""
        import traceback

        module, name = type(e).__module__, type(e).__qualname__
        self.events.append((time.time_ns(), "exception", {
            "exception.type": f"{module}.{name}" if module and module != "builtins" else name,
            "exception.message": str(e), "exception.stacktrace": "".join(traceback.format_exception(e)),
            "exception.escaped": "False"}))

    def end(self, end_time: int | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        if self.sampled:
            from rolloutd.crds.kit.otlp import Finished

            finished(Finished(self.name, self.trace_id, self.span_id, self.parent_id, self.start,
                              end_time or time.time_ns(), self.attributes, self.error, True, self.remote,
                              tuple(self.events)))


_current: contextvars.ContextVar[Span | None] = contextvars.ContextVar("rolloutd_span", default=None)


def _new(name: str, attributes: dict[str, Any] | None, start_time: int | None, parent: tuple | None) -> Span:
    """A span child of `parent` (trace id, span id, sampled, remote), or of a new trace; sampled as the provider's
    sampler says (the SDK's default, parent-based, without a call: the parent's flag)."""
    attrs = _clean(attributes) if attributes else {}
    span_id = random.getrandbits(64) or 1
    if parent is None:
        trace_id = random.getrandbits(128) or 1
        keep = _provider.sampler.should_sample(None, trace_id, name, attributes=attrs).decision.is_sampled()
        return Span(name, trace_id, span_id, 0, False, keep, start_time or time.time_ns(), attrs)
    trace_id, parent_id, parent_sampled, remote = parent
    if _follows_parent:
        keep = parent_sampled
    else:
        from opentelemetry import trace as api

        ctx = api.set_span_in_context(api.NonRecordingSpan(api.SpanContext(
            trace_id, parent_id, remote, api.TraceFlags(1 if parent_sampled else 0))))
        keep = _provider.sampler.should_sample(ctx, trace_id, name, attributes=attrs).decision.is_sampled()
    return Span(name, trace_id, span_id, parent_id, remote, keep, start_time or time.time_ns(), attrs)


def _parent_of(parent: str | None) -> tuple | None:
    if parent:
        got = _parse(parent)
        if got is not None:   # a malformed one gives a new trace: it is the peer's word
            return (*got, True)
    cur = _current.get()
    return (cur.trace_id, cur.span_id, cur.sampled, False) if cur is not None else None


class _Scope:
    """`span`'s block: the span current inside it, ended after it (an exception escaping it recorded, as the SDK's
    `use_span` does: not a cancellation). A class, not a generator: ~1 µs less a span."""
    __slots__ = ("span", "token")

    def __init__(self, s: Any) -> None:
        self.span = s

    def __enter__(self) -> Any:
        self.token = _current.set(self.span)
        return self.span

    def __exit__(self, kind: Any, e: Any, tb: Any) -> None:
        _current.reset(self.token)
        s = self.span
        if isinstance(e, Exception) and s.is_recording():
            s.record_exception(e)
            s.error = f"{type(e).__name__}: {e}"
        s.end()


class _Off:
    """`span`'s block with tracing off: nothing (one object for every call)."""

    def __enter__(self) -> Any:
        return NOTHING

    def __exit__(self, *exc: Any) -> None:
        pass


OFF = _Off()


def span(name: str, attributes: dict[str, Any] | None = None, *, start_time: int | None = None,
         parent: str | None = None) -> Any:
    """A span around the block (`with span(...) as s:`), the current one inside it (child of `parent`, a W3C
    traceparent, when given, else of the current span). An exception escaping the block marks it as an error.
    No-op with tracing off."""
    if _tracer is None:
        return OFF
    return _Scope(_new(name, attributes, start_time, _parent_of(parent)))


def set_attributes(s: Any, attributes: dict[str, Any]) -> None:
    if s is not NOTHING:
        s.set_attributes(attributes)


def error(s: Any, description: str) -> None:
    """Mark `s` as failed with `description` (an infra or config failure, never a low reward)."""
    if s is not NOTHING:
        s.set_status_error(description[:500])


def traceparent(s: Any = None) -> str | None:
    """The W3C traceparent of `s` (default the current span), for another process; None with tracing off."""
    s = s if s is not None else _current.get()
    if _tracer is None or not isinstance(s, Span):
        return None
    return traceparent_of(s.trace_id, s.span_id, s.sampled)


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
