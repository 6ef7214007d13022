"""The typed seam a task handler sees (agents/tasks/seams.py): the real sandbox and the real LLM backends
satisfy the `Sandbox` and `LLM` protocols, method by method, signature by signature (parameter names, kinds,
defaults): a change on either side that a handler would feel fails here."""
from __future__ import annotations

import functools
import inspect
import typing

import pytest

from rolloutd.agents.daemon.llmgate import TrackedLLM
from rolloutd.agents.vllm_backend import VLLMBackend
from rolloutd.agents.tasks import base
from rolloutd.agents.tasks.seams import (LLM, AgentConfig, HostSandbox, RolloutContext, Sandbox, SandboxFactory,
                                        Tokenizer)
from rolloutd.crds.trajectory import Trajectory
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
        # the protocol's parameters exactly, then only optional ones (TrackedLLM's `on_tokens`, the gateway's stream)
        shape, extra = _shape(got)[:len(_shape(want))], _shape(got)[len(_shape(want)):]
        assert shape == _shape(want), f"{real.__name__}.{name}{inspect.signature(got)} != {inspect.signature(want)}"
        assert all(default is not inspect.Parameter.empty for _, _, default in extra), \
            f"{real.__name__}.{name}: a parameter the protocol's callers do not pass must have a default"


def test_the_handler_seam_is_typed():
    """`TaskHandler.init/run/eval` take the protocols, not `Any`."""
    for name in ("init", "run", "eval"):
        hints = typing.get_type_hints(getattr(base.TaskHandler, name))
        assert hints["sandbox"] == Sandbox | None, name
    assert typing.get_type_hints(base.TaskHandler.run)["llm"] == LLM | None


def _members(protocol: type) -> list[str]:
    return sorted(n for n in protocol.__dict__ if not n.startswith("_")) + sorted(
        getattr(protocol, "__annotations__", {}))


def test_the_chat_tokenizer_satisfies_the_tokenizer_seam(tmp_path):
    """Every method of `Tokenizer` is `ChatTokenizer`'s, signature by signature; its properties are properties
    there too, and an instance (the tiny model's) has the plain attributes."""
    from rolloutd.agents.engine.model_build import build_tiny_tokenizer
    from rolloutd.agents.tokenizer import ChatTokenizer

    build_tiny_tokenizer(tmp_path)
    real = ChatTokenizer(tmp_path)
    for name in _members(Tokenizer):
        want = Tokenizer.__dict__.get(name)
        if isinstance(want, property):
            assert isinstance(inspect.getattr_static(ChatTokenizer, name), (property, functools.cached_property)), name
        elif callable(want):
            assert _shape(getattr(ChatTokenizer, name)) == _shape(want), name
        else:
            assert hasattr(real, name), name


def test_the_real_sandbox_is_a_host_sandbox():
    for name in ("spec", "root", "workspace", "limits"):
        assert name in HostSandbox.__annotations__
    assert _shape(RealSandbox.give) == _shape(HostSandbox.give)


def test_run_and_eval_are_typed_end_to_end():
    """`run` takes the tokenizer, the job's `AgentConfig` and the `RolloutContext`, not `Any`; `eval` declares
    the fresh-sandbox factory the daemon passes (`eval_sandbox`), and every built-in's override keeps the seam."""
    from rolloutd.agents.tasks import get_handler, known_kinds

    run = typing.get_type_hints(base.TaskHandler.run)
    assert (run["tokenizer"], run["config"], run["ctx"]) == (Tokenizer | None, AgentConfig, RolloutContext)
    assert typing.get_type_hints(base.TaskHandler.eval)["sandbox_factory"] == SandboxFactory | None
    for kind in known_kinds():
        cls = type(get_handler(kind))
        for name in ("init", "run", "eval"):
            hints = typing.get_type_hints(getattr(cls, name))
            assert hints["sandbox"] in (Sandbox | None, HostSandbox | None), (kind, name, hints["sandbox"])
            assert hints["return"] in (None, type(None), Trajectory, base.Reward), (kind, name)
        assert "sandbox_factory" in inspect.signature(cls.eval).parameters, kind


@pytest.mark.parametrize("given, value", [(base.Reward(value=0.5), 0.5), (1, 1.0), (0.25, 0.25)])
def test_a_reward_is_a_reward_or_a_number(given, value):
    assert base.as_reward(given).value == value


@pytest.mark.parametrize("given", [None, "1", True, {"value": 1.0}])
def test_anything_else_is_the_evaluators_failure(given):
    with pytest.raises(base.EvalError):
        base.as_reward(given)
