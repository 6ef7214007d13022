"""Fixtures for tests/agents/tasks: the repository root as cwd (the shipped examples/ paths resolve) and
real bwrap sandboxes (`rolloutd.sandbox`) for the handlers whose EVAL runs tests (code, swe)."""
from pathlib import Path

import pytest

from rolloutd.sandbox import SandboxSpec, get_runtime

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _repo_root_cwd(monkeypatch):
    monkeypatch.chdir(ROOT)
    yield


class Sandboxes:
    """Creates real sandboxes: `await sandboxes.create()`; `spec`/`runtime` for handler options."""

    def __init__(self, runtime, spec):
        self.runtime, self.spec = runtime, spec

    async def create(self):
        return await self.runtime.create(self.spec)


@pytest.fixture
def sandboxes():
    return Sandboxes(get_runtime("bwrap"), SandboxSpec(runtime="bwrap", image="host", network=False))
