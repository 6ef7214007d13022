"""The harness dialects' one shape (agents/wire/dialect.py): every dialect the gateway serves has the `Dialect`
protocol's functions with its signatures, and its `Events` the stream's; the gateway routes exactly the table."""
from __future__ import annotations

import inspect

import pytest

from rolloutd.agents.gateway import server as gateway
from rolloutd.agents.wire.dialect import DIALECTS, Dialect, Events


def _shape(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("path", sorted(DIALECTS))
def test_every_dialect_has_the_protocols_shape(path):
    wire = DIALECTS[path]
    assert isinstance(wire, Dialect), path
    for name in ("parse", "reply", "error"):
        assert _shape(getattr(wire, name))[:len(_shape(getattr(Dialect, name)))] == _shape(getattr(Dialect, name)), \
            f"{wire.__name__}.{name}"
    for name in ("__init__", "start", "text", "end", "failed"):
        assert _shape(getattr(wire.Events, name)) == _shape(getattr(Events, name)), f"{wire.__name__}.Events.{name}"


def test_the_gateway_serves_every_dialect_at_its_path():
    for path, wire in DIALECTS.items():
        method, _, routed = gateway._ROUTES[path]
        assert (method, routed) == ("POST", wire)
