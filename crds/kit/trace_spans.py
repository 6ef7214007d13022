"""A span of this process while it is open (`Span`), and `span`, the block that makes it the current one.

Called by the node's spans (agents/spans.py), its agent loop and its harness gateway; an ended span goes to
crds/kit/tracing.py's `finished` (encoded by crds/kit/otlp.py). Tracing's state (on or off, the provider's sampler,
the current span's context variable) is crds/kit/tracing.py's, read here at every call: with tracing off, `span`
gives `OFF`, whose span `NOTHING` takes every call and does nothing.
"""
from __future__ import annotations

import random
import time
from typing import Any

from rolloutd.crds.kit import tracing
from rolloutd.crds.kit.otlp import clean as _clean
from rolloutd.crds.kit.otlp import parse_traceparent as _parse


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

            tracing.finished(Finished(self.name, self.trace_id, self.span_id, self.parent_id, self.start,
                              end_time or time.time_ns(), self.attributes, self.error, True, self.remote,
                              tuple(self.events)))


def _new(name: str, attributes: dict[str, Any] | None, start_time: int | None, parent: tuple | None) -> Span:
    """A span child of `parent` (trace id, span id, sampled, remote), or of a new trace; sampled as the provider's
    sampler says (the SDK's default, parent-based, without a call: the parent's flag)."""
    attrs = _clean(attributes) if attributes else {}
    span_id = random.getrandbits(64) or 1
    if parent is None:
        trace_id = random.getrandbits(128) or 1
        keep = tracing._provider.sampler.should_sample(None, trace_id, name, attributes=attrs).decision.is_sampled()
        return Span(name, trace_id, span_id, 0, False, keep, start_time or time.time_ns(), attrs)
    trace_id, parent_id, parent_sampled, remote = parent
    if tracing._follows_parent:
        keep = parent_sampled
    else:
        from opentelemetry import trace as api

        ctx = api.set_span_in_context(api.NonRecordingSpan(api.SpanContext(
            trace_id, parent_id, remote, api.TraceFlags(1 if parent_sampled else 0))))
        keep = tracing._provider.sampler.should_sample(ctx, trace_id, name, attributes=attrs).decision.is_sampled()
    return Span(name, trace_id, span_id, parent_id, remote, keep, start_time or time.time_ns(), attrs)


def _parent_of(parent: str | None) -> tuple | None:
    if parent:
        got = _parse(parent)
        if got is not None:   # a malformed one gives a new trace: it is the peer's word
            return (*got, True)
    cur = tracing._current.get()
    return (cur.trace_id, cur.span_id, cur.sampled, False) if cur is not None else None


class _Scope:
    """`span`'s block: the span current inside it, ended after it (an exception escaping it recorded, as the SDK's
    `use_span` does: not a cancellation). A class, not a generator: ~1 µs less a span."""
    __slots__ = ("span", "token")

    def __init__(self, s: Any) -> None:
        self.span = s

    def __enter__(self) -> Any:
        self.token = tracing._current.set(self.span)
        return self.span

    def __exit__(self, kind: Any, e: Any, tb: Any) -> None:
        tracing._current.reset(self.token)
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
    if tracing._tracer is None:
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
    s = s if s is not None else tracing._current.get()
    if tracing._tracer is None or not isinstance(s, Span):
        return None
    return tracing.traceparent_of(s.trace_id, s.span_id, s.sampled)
