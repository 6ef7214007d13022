"""The typed seam a task handler sees (agents/tasks/seams.py): the real sandbox and the real LLM backends
satisfy the `Sandbox` and `LLM` protocols, method by method, signature by signature (parameter names, kinds,
defaults): a change on either side that a handler would feel fails here."""
from __future__ import annotations

import inspect
import typing

import pytest

from rolloutd.agents.daemon.llmgate import TrackedLLM
from rolloutd.agents.llm import VLLMBackend
from rolloutd.agents.tasks import base
from rolloutd.agents.tasks.seams import LLM, Sandbox
from rolloutd.sandbox import Sandbox as RealSandbox


def _methods(protocol: type) -> list[str]:
    return sorted(n for n in protocol.__dict__ if not n.startswith("_") and callable(protocol.__dict__[n]))


def _shape(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("protocol, real", [(Sandbox, RealSandbox), (LLM, VLLMBackend), (LLM, TrackedLLM)])
def test_the_real_classes_satisfy_the_seam(protocol, real):
    assert issubclass(real, protocol)  # runtime_checkable: the methods exist
    for name in _methods(protocol):
        want, got = getattr(protocol, name), getattr(real, name)
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(want), f"{real.__name__}.{name}"
        assert _shape(got) == _shape(want), f"{real.__name__}.{name}{inspect.signature(got)} != {inspect.signature(want)}"


def test_the_handler_seam_is_typed():
    """`TaskHandler.init/run/eval` take the protocols, not `Any`."""
    for name in ("init", "run", "eval"):
        hints = typing.get_type_hints(getattr(base.TaskHandler, name))
        assert hints["sandbox"] == Sandbox | None, name
    assert typing.get_type_hints(base.TaskHandler.run)["llm"] == LLM | None
