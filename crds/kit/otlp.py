"""Finished spans recorded as plain tuples and encoded here as OTLP protobuf: the controller's spans of every attempt
(controller/work/tracing.py) and the node daemon's (crds/kit/trace_spans.py `Span`) at a fraction of the SDK's cost
per span. Next step: the bytes go out in crds/kit/otlp_batches.py's `Batches` (crds/kit/tracing.py's `finished`).

Why: the SDK's encoder builds a protobuf object per attribute (~65 µs for a 14-attribute span on this box, against
~14 µs here; bench/results/RESULTS-tracing.md), and a controller at 1000 nodes takes ~0.4 ms of CPU per rollout in
all.
"""
from __future__ import annotations

import re
import struct
from collections.abc import Iterable
from typing import Any, NamedTuple

_double = struct.Struct("<d").pack
_fixed64 = struct.Struct("<Q").pack
_fixed32 = struct.Struct("<I").pack
_MASK64 = (1 << 64) - 1


class Finished(NamedTuple):
    """One ended span: ids as ints (parent 0: a root), times in ns since the epoch, `error`: its status message."""
    name: str
    trace_id: int
    span_id: int
    parent_id: int
    start: int
    end: int
    attributes: dict[str, Any]
    error: str | None = None
    sampled: bool = True
    remote: bool = False   # the parent is another process's (the SDK's flags say so)
    events: tuple = ()     # (time ns, name, attributes) each: an exception's (crds/kit/tracing.py `Span`)


def _plain(v: Any) -> Any:
    """A subclass's value as its base type (a str enum as its string, as the SDK's encoder sends it), else None."""
    if isinstance(v, bool):
        return bool(v)
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, int):
        return int(v)
    if isinstance(v, float):
        return float(v)
    return None


def clean(attributes: dict[str, Any]) -> dict[str, Any]:
    """OTLP attribute values: str, bool, int, float or their lists; None dropped, anything else as str."""
    out: dict[str, Any] = {}
    for k, v in attributes.items():
        t = type(v)
        if t is str or t is int or t is float or t is bool:
            out[k] = v
        elif v is None:
            continue
        elif isinstance(v, (str, bool, int, float)):
            out[k] = _plain(v)
        elif isinstance(v, (list, tuple)) and all(isinstance(x, (str, bool, int, float)) for x in v):
            out[k] = [x if type(x) in (str, int, float, bool) else _plain(x) for x in v]
        else:
            out[k] = str(v)
    return out


_TRACEPARENT = re.compile(r"^[ \t]*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(?:(-.*)|[ \t]*)$")


def parse_traceparent(value: str) -> tuple[int, int, bool] | None:
    """(trace id, span id, sampled) of a W3C traceparent, None when malformed (the SDK propagator's checks)."""
    m = _TRACEPARENT.match(value) if len(value) <= 512 else None
    if m is None or m.group(1) == "ff" or (m.group(1) == "00" and m.group(5)):
        return None
    trace_id, span_id = int(m.group(2), 16), int(m.group(3), 16)
    return (trace_id, span_id, bool(int(m.group(4), 16) & 1)) if trace_id and span_id else None


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: bytes, body: bytes) -> bytes:
    """A length-delimited field: its tag byte(s), the length, the bytes (one %-format when the length fits a byte:
    ~5× cheaper than concatenating)."""
    n = len(body)
    return b"%b%c%b" % (tag, n, body) if n < 0x80 else tag + _varint(n) + body


def _any(v: Any) -> bytes:
    """An `AnyValue` message: str, bool, int, float, or a list of those (anything else as its str)."""
    t = type(v)
    if t is str:
        vb = v.encode()
        return b"\x0a%c%b" % (len(vb), vb) if len(vb) < 0x80 else _field(b"\x0a", vb)
    if t is bool:
        return b"\x10\x01" if v else b"\x10\x00"
    if t is int:
        return b"\x18" + _varint(v & _MASK64)
    if t is float:
        return b"\x21" + _double(v)
    if t in (list, tuple):
        return _field(b"\x2a", b"".join(_field(b"\x0a", _any(x)) for x in v))
    return _field(b"\x0a", str(v).encode())


_keys: dict[str, bytes] = {}


def key_value(key: str, v: Any) -> bytes:
    """A `KeyValue` message's bytes."""
    k = _keys.get(key)
    if k is None:
        k = _field(b"\x0a", key.encode())
        if len(_keys) < 1000:   # the keys are few: every span's, a few events'
            _keys[key] = k
    a = _any(v)
    return b"%b\x12%c%b" % (k, len(a), a) if len(a) < 0x80 else k + _field(b"\x12", a)


_cache: dict[tuple[str, type, Any], bytes] = {}


def _attribute(key: str, v: Any) -> bytes:
    """A span's attribute field (a `KeyValue`), remembered: most values repeat from one attempt to the next."""
    k = (key, type(v), v) if type(v) is not list else None
    out = _cache.get(k) if k is not None else None
    if out is None:
        out = _field(b"\x4a", key_value(key, v))
        if k is not None:
            if len(_cache) > 20_000:
                _cache.clear()
            _cache[k] = out
    return out


def attributes(pairs: Iterable[tuple[str, Any]]) -> bytes:
    """Attribute fields of a span (None values left out), each remembered as `_attribute` does."""
    return b"".join([_attribute(k, v) for k, v in pairs if v is not None])


def fresh(pairs: Iterable[tuple[str, Any]]) -> bytes:
    """`attributes` whose values seldom repeat (ids): encoded, not remembered; a short str, a float or a non-negative
    int in one %-format each."""
    out = b""
    for k, v in pairs:
        kb = _keys.get(k)
        t = type(v)
        if kb is not None:
            if t is str:
                vb = v.encode()
                n = len(vb)
                if len(kb) + n < 0x7C:   # KeyValue{key, value: AnyValue{string}}, every length one byte
                    out += b"\x4a%c%b\x12%c\x0a%c%b" % (len(kb) + n + 4, kb, n + 2, n, vb)
                    continue
            elif t is float and len(kb) < 0x75:
                out += b"\x4a%c%b\x12\x09\x21%b" % (len(kb) + 11, kb, _double(v))
                continue
            elif t is int and v >= 0 and len(kb) < 0x70:
                vv = _varint(v)
                out += b"\x4a%c%b\x12%c\x18%b" % (len(kb) + 3 + len(vv), kb, 1 + len(vv), vv)
                continue
        if v is not None:
            out += _field(b"\x4a", key_value(k, v))
    return out


# Span{trace_id, span_id, [parent_span_id], name, kind INTERNAL, start, end, attributes, events, status, flags}
_SPAN = b"\x0a\x10%b\x12\x08%b%b%b\x30\x01\x39%b\x41%b%b%b%b\x85\x01%b"
_FLAGS = {False: _fixed32(0x100), True: _fixed32(0x300)}   # "whether the parent is remote" known, as the SDK's
_names: dict[str, bytes] = {}   # a span name's field


def encode(name: str, trace_id: int, span_id: int, parent_id: int, start: int, end: int, attrs: bytes,
           error: str | None = None, remote: bool = False, events: bytes = b"") -> bytes:
    """A `Span` message (kind INTERNAL) from its attribute fields already encoded (`attributes`), field for field
    what the SDK's encoder writes (one %-format)."""
    nb = _names.get(name)
    if nb is None:
        nb = _field(b"\x2a", name.encode())
        if len(_names) < 1000:
            _names[name] = nb
    return _SPAN % (trace_id.to_bytes(16, "big"), span_id.to_bytes(8, "big"),
                    b"\x22\x08" + parent_id.to_bytes(8, "big") if parent_id else b"", nb,
                    _fixed64(start), _fixed64(end), attrs, events, b"\x7a\x00" if error is None else status(error),
                    _FLAGS[remote])


def template(name: str, child: bool) -> bytes:
    """`encode`'s %-format for spans named `name` (a local parent, no events): (trace id, span id, [parent id when
    `child`]: bytes; start, end: fixed64 bytes; attribute fields; `status`), nothing looked up (the controller's)."""
    return (b"\x0a\x10%b\x12\x08%b" + (b"\x22\x08%b" if child else b"") + _field(b"\x2a", name.encode())
            + b"\x30\x01\x39%b\x41%b%b%b\x85\x01" + _FLAGS[False])


def status(error: str | None) -> bytes:
    """A span's `Status` field: {message, code ERROR}, else empty."""
    return b"\x7a\x00" if error is None else _field(b"\x7a", _field(b"\x12", error.encode()) + b"\x18\x02")


def span(s: Finished) -> bytes:
    """A `Span` message of `s` (`encode`)."""
    events = b"".join(   # Event{time_unix_nano, name, attributes}
        _field(b"\x5a", b"\x09" + _fixed64(at) + _field(b"\x12", name.encode())
               + b"".join(_field(b"\x1a", key_value(k, v)) for k, v in attrs.items() if v is not None))
        for at, name, attrs in s.events)
    return encode(s.name, s.trace_id, s.span_id, s.parent_id, s.start, s.end, attributes(s.attributes.items()),
                  s.error, s.remote, events)


def request(resource: dict[str, Any], scope: str, spans: Iterable[Finished | bytes]) -> bytes:
    """An `ExportTraceServiceRequest`: one resource, one instrumentation scope, `spans` (each a `Finished`, or a
    `Span` message already encoded: `encode`)."""
    res = b"".join(_field(b"\x0a", key_value(k, v)) for k, v in resource.items())
    body = b"".join([_field(b"\x12", s if type(s) is bytes else span(s)) for s in spans])
    scope_spans = _field(b"\x0a", _field(b"\x0a", scope.encode())) + body
    return _field(b"\x0a", _field(b"\x0a", res) + _field(b"\x12", scope_spans))
