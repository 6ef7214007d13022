"""The failure taxonomy (crds/errors.py): every exception class of the product hangs off one root, and
`classify` gives each its `FailureKind`; the agent loop and the node pipeline class failures through it.

The table below is the taxonomy written out: a class added to the product without a row here fails
`test_every_exception_class_is_in_the_table`, one outside the root fails `test_every_class_is_classified`.
"""
from __future__ import annotations

import ast
import asyncio
import importlib
from pathlib import Path

import pytest

from rolloutd.crds.errors import AgentError, ConfigurationError, InfraError, RolloutdError, classify
from rolloutd.crds.trajectory import FailureKind

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("crds", "sandbox", "agents", "controller")
# The exec server runs inside the sandbox on the standard library only; its errors cross the socket as
# answers (`ok: false`), never as Python exceptions, so they stay outside the product's taxonomy.
OUTSIDE = {"rolloutd.sandbox.server.bash.SessionDead", "rolloutd.sandbox.server.wire.RequestError",
           "rolloutd.sandbox.server.kernel.KernelDied"}

I, C, A = FailureKind.infra, FailureKind.config, FailureKind.agent
# class → (how to make one, the kind it classifies as)
TABLE: dict[str, list[tuple[tuple, dict, FailureKind]]] = {
    "rolloutd.crds.errors.RolloutdError": [((), {}, I)],
    "rolloutd.crds.errors.InfraError": [((), {}, I)],
    "rolloutd.crds.errors.ConfigurationError": [((), {}, C)],
    "rolloutd.crds.errors.AgentError": [((), {}, A)],
    "rolloutd.crds.errors.StatusError": [((), {}, I)],
    "rolloutd.crds.nodeenv.NodeEnvError": [((), {}, C)],
    "rolloutd.crds.kit.reference.Undescribed": [((), {}, C)],
    "rolloutd.crds.kit.settings.SettingsError": [((), {}, C)],
    "rolloutd.crds.kit.safe_read.DataReadError": [(("spec.x", "/p", "why"), {}, C)],
    "rolloutd.sandbox.image.build_step.SizeLimitExceeded": [((), {}, I)],
    "rolloutd.sandbox.image.dockerfile.DockerfileError": [((), {}, C)],
    "rolloutd.sandbox.errors.SandboxError": [((), {}, I)],
    "rolloutd.sandbox.errors.SandboxCreateError": [((), {}, I)],
    "rolloutd.sandbox.errors.SandboxDied": [((), {}, I)],
    "rolloutd.sandbox.errors.SandboxTimeout": [((), {}, I)],
    "rolloutd.sandbox.errors.RuntimeUnavailable": [((), {}, I)],
    "rolloutd.sandbox.errors.ExecError": [((), {}, A)],
    "rolloutd.sandbox.image.rootfs.ImageBuildError": [((), {}, I)],
    "rolloutd.sandbox.image.rootpath.OutsideRoot": [((), {}, C)],
    "rolloutd.agents.daemon.controller_client.ControllerError": [
        (("m",), {}, I), (("m", 503), {}, I), (("m", 429), {}, I), (("m", 403), {}, C)],
    "rolloutd.agents.daemon.options.NodeError": [(("m",), {}, I), (("m",), {"config": "spec.x"}, C)],
    "rolloutd.agents.daemon.pipeline._Infra": [((), {}, I)],
    "rolloutd.agents.daemon.pipeline._StageFailed": [(("m",), {}, I), (("m", C), {}, C)],
    "rolloutd.agents.engine.venv.EngineError": [((), {}, I)],
    "rolloutd.agents.llm.BackendError": [(("m",), {}, I), (("m",), {"unreachable": True}, I)],
    "rolloutd.agents.llm.Preempted": [(("m",), {}, I)],
    "rolloutd.agents.llm.RequestRejected": [((), {}, C)],
    "rolloutd.agents.wire.openai.Invalid": [(("m",), {}, A)],
    "rolloutd.agents.tasks.base.DatasetError": [((), {}, C)],
    "rolloutd.agents.tasks.base.EvalError": [((), {}, I)],
    "rolloutd.agents.tasks.base.ConfigError": [((), {}, C)],
    "rolloutd.agents.tasks.judge.JudgementTimedOut": [((), {}, A)],
    "rolloutd.agents.tasks.math._Symbolic": [((), {}, I)],
    "rolloutd.agents.tasks.registry.UnknownTaskKind": [((), {}, C)],
    "rolloutd.agents.loop.tools.ToolInfraError": [((), {}, I)],
    "rolloutd.agents.loop.tools.ToolHung": [((), {}, I)],
    "rolloutd.client.errors.ClientError": [(("m",), {}, I), (("m", {"code": 500}), {}, I)],
    "rolloutd.client.errors.BadRequest": [(("m", {"code": 400}), {}, C)],
    "rolloutd.client.errors.Unauthorized": [(("m", {"code": 401}), {}, C)],
    "rolloutd.client.errors.NotFound": [(("m", {"code": 404}), {}, C)],
    "rolloutd.client.errors.Conflict": [(("m", {"code": 409}), {}, C)],
    "rolloutd.client.errors.Gone": [(("m", {"code": 410}), {}, C)],
    "rolloutd.client.errors.Invalid": [(("m", {"code": 422}), {}, C)],
    "rolloutd.client.errors.ConnectionFailed": [(("m",), {}, I)],
    "rolloutd.client.errors.WaitTimeout": [(("m",), {}, I)],
    "rolloutd.client.errors.JobEnded": [(("m",), {}, I)],
    "rolloutd.controller.errors.ApiError": [(("m",), {}, I)],
    "rolloutd.controller.errors.BadRequest": [(("m",), {}, C)],
    "rolloutd.controller.errors.Unauthorized": [(("m",), {}, C)],
    "rolloutd.controller.errors.Forbidden": [(("m",), {}, C)],
    "rolloutd.controller.errors.NotFound": [(("m",), {}, C)],
    "rolloutd.controller.errors.AlreadyExists": [(("m",), {}, C)],
    "rolloutd.controller.errors.Conflict": [(("m",), {}, C)],
    "rolloutd.controller.errors.Gone": [(("m",), {}, C)],
    "rolloutd.controller.ui.live.JobGone": [((404, "m"), {}, C)],
    "rolloutd.controller.errors.TooLarge": [(("m",), {}, C)],
    "rolloutd.controller.errors.UnsupportedMediaType": [(("m",), {}, C)],
    "rolloutd.controller.errors.Invalid": [(("m",), {}, C)],
    "rolloutd.controller.errors.TooManyRequests": [(("m",), {}, I)],
    "rolloutd.controller.errors.ServiceUnavailable": [(("m",), {}, I)],
    "rolloutd.controller.ha.leadership.Fenced": [(("m",), {}, I)],
    "rolloutd.controller.ha.serving.NotOwner": [(("node", "http://b"), {}, I)],
    "rolloutd.controller.work.group_commit.GroupRolledBack": [(("m",), {}, I)],
    "rolloutd.controller.executors.base.ExecutorError": [(("m",), {}, I), (("m",), {"permanent": True}, C)],
    "rolloutd.controller.executors.logs.NoLogs": [((), {}, C)],
    "rolloutd.integrations.trl.rollouts.StalePolicy": [((), {}, I)],
    "rolloutd.integrations.samples.NoUsableSample": [(("m",), {}, I)],
    "rolloutd.controller.kube.patch.ApplyConflict": [(("m",), {}, C)],
    "rolloutd.controller.store.db.SchemaTooNew": [(("m",), {}, C)],
    "rolloutd.controller.store.db.ServerTooOld": [(("m",), {}, C)],
    "rolloutd.controller.store.schema.Unservable": [(("job", ValueError("v")), {}, I)],
}


TRAINERS = {"verl", "skyrl"}  # the adapters whose modules import their trainer at the top


def _module(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if parts[:2] in (["controller", "client"], ["controller", "integrations"]):
        parts = parts[1:]
    return "rolloutd." + ".".join(parts)


def _exception_classes() -> dict[str, type]:
    """Every exception class defined at the top of a product module (found with `ast`, then imported)."""
    found: dict[str, type] = {}
    for part in PRODUCT:
        for path in sorted((REPO / part).rglob("*.py")):
            names = [n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)]
            if not names:
                continue
            try:
                module = importlib.import_module(_module(path.relative_to(REPO)))
            except ModuleNotFoundError as e:  # a trainer's adapter: imported (and checked) in that trainer's venv
                if e.name and e.name.split(".")[0] in TRAINERS:
                    continue
                raise
            for name in names:
                cls = getattr(module, name)
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    found[f"{module.__name__}.{name}"] = cls
    return found


def test_every_exception_class_is_in_the_table():
    found = set(_exception_classes()) - OUTSIDE
    assert found - set(TABLE) == set(), "exception classes without a row in TABLE"
    assert set(TABLE) - found == set(), "rows of TABLE naming no class of the product"


def test_every_class_is_classified():
    classes = _exception_classes()
    for name, rows in TABLE.items():
        cls = classes[name]
        assert issubclass(cls, RolloutdError), f"{name} is outside the taxonomy's root"
        for args, kwargs, kind in rows:
            assert classify(cls(*args, **kwargs)) is kind, (name, args, kwargs)


def test_one_class_per_name_and_one_root():
    """`RolloutdError` is one class: the client's public name (`rolloutd.client.RolloutdError`) is the product's root,
    and every error the client raises derives from it through `ClientError`."""
    import rolloutd.client
    from rolloutd.client.errors import ClientError

    classes = _exception_classes()
    assert [n for n in classes if n.rpartition(".")[2] == "RolloutdError"] == ["rolloutd.crds.errors.RolloutdError"]
    assert rolloutd.client.RolloutdError is RolloutdError and "RolloutdError" in rolloutd.client.__all__
    assert all(issubclass(cls, ClientError) for name, cls in classes.items() if name.startswith("rolloutd.client."))


def test_builtin_bases_are_kept():
    """Re-parenting kept what callers catch: `except ValueError` still takes a dataset error, and so on."""
    from rolloutd.agents.tasks.base import ConfigError, DatasetError, EvalError
    from rolloutd.agents.tasks.registry import UnknownTaskKind
    from rolloutd.client.errors import WaitTimeout
    from rolloutd.sandbox.image.rootpath import OutsideRoot

    assert issubclass(DatasetError, ValueError) and issubclass(ConfigError, ValueError)
    assert issubclass(EvalError, RuntimeError) and issubclass(UnknownTaskKind, LookupError)
    assert issubclass(OutsideRoot, OSError) and issubclass(WaitTimeout, TimeoutError)


@pytest.mark.parametrize("exc", [RuntimeError("bug"), KeyError("k"), OSError(5, "io"), TimeoutError(),
                                 asyncio.TimeoutError(), ValueError("v"), Exception()])
def test_unknown_exceptions_are_infra(exc):
    """Anything outside the taxonomy is our fault: never the policy's, never a reward of 0."""
    assert classify(exc) is FailureKind.infra


def test_three_families():
    assert {InfraError.kind, ConfigurationError.kind, AgentError.kind} == {I, C, A}


def test_the_call_sites_class_through_classify():
    """The agent loop and the node pipeline call `classify`; neither makes a `Failure(kind=FailureKind.x)` of an
    exception it caught (the old code mapped each exception class to a kind by hand in both places)."""
    for rel in ("agents/loop/run.py", "agents/daemon/pipeline.py"):
        tree = ast.parse((REPO / rel).read_text())
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert "classify" in calls, rel
        for handler in (n for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler)):
            by_hand = [k for n in ast.walk(handler) if isinstance(n, ast.Call) for k in n.keywords
                       if k.arg == "kind" and isinstance(k.value, ast.Attribute)]
            assert not by_hand, f"{rel}:{handler.lineno} classes an exception by hand"
