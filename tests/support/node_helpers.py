"""Helpers shared by the tests/agents/daemon modules: job specs, daemon options, waiting with a deadline."""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest

from support.fake_controller import FakeController
from support.waiting import until  # noqa: F401  (re-exported for the node tests)

TOKEN = "join-secret"

BASE_SPEC: dict[str, Any] = {
    "tasks": {"kind": "scripted", "source": "/dev/null"},
    "llm": {"tokenizer": "", "backends": [{"url": "http://127.0.0.1:9/llm"}]},
    "agent": {"maxTurns": 2, "tools": ["bash"], "sampling": {"maxTokensPerTurn": 32, "maxTotalTokens": 1024, "seed": 3}},
    "sandbox": {"runtime": "bwrap", "image": "host", "limits": {"wallSeconds": 300, "memoryMB": 2048}},
    "pipeline": {"workersPerNode": {"init": 2, "run": 2, "eval": 2}},
    "timeouts": {"initSeconds": 30, "runSeconds": 60, "evalSeconds": 30, "actionSeconds": 10},
}


def scripted_plugin_path(tmp_path: Path) -> str:
    """A PYTHONPATH under which a `rolloutd node` subprocess finds the scripted task kind as a plug-in: a dist-info
    with a `rolloutd.tasks` entry point (found by `get_handler` like any third-party kind), and its module."""
    from support import scripted_tasks

    site = tmp_path / "plugin"
    info = site / "scripted_tasks_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: scripted-tasks-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rolloutd.tasks]\nscripted = scripted_tasks:ScriptedTask\n")
    return os.pathsep.join([str(site), str(Path(scripted_tasks.__file__).resolve().parent)])


def tiny_dir() -> Path:
    from rolloutd.agents.engine.model_dirs import is_ready, model_dir

    if not is_ready("tiny"):
        pytest.skip("the tiny model is not prepared (rolloutd serve-model --prepare-only -m tiny)")
    return model_dir("tiny")


def make_spec(*, workers: tuple[int, int, int] = (2, 2, 2), **sections: Any) -> dict:
    """BASE_SPEC with the tiny tokenizer, the given pool sizes and shallow-merged sections."""
    spec = copy.deepcopy(BASE_SPEC)
    spec["llm"]["tokenizer"] = str(tiny_dir())
    spec["pipeline"]["workersPerNode"] = dict(zip(("init", "run", "eval"), workers))
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def options(fake: FakeController, name: str = "node-a", **kw: Any):
    from rolloutd.agents.daemon.options import NodeOptions
    from rolloutd.crds.kit.settings import SandboxSettings

    kw.setdefault("lease_wait", 0.5)
    kw.setdefault("retry_max", 0.3)
    kw.setdefault("job", fake.job)
    kw.setdefault("sandbox", SandboxSettings.from_env())  # as `rolloutd node` reads it (the sandbox_dir fixture's)
    return NodeOptions(controller=fake.url, token=TOKEN, name=name, **kw)


def sandbox_pids(sandbox_id: str) -> list[int]:
    """Processes still carrying this sandbox's id (the sandbox package's own leftover check)."""
    from rolloutd.sandbox.host.footprint import pids_with_id

    return pids_with_id(sandbox_id)
