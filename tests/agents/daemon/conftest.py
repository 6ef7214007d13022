"""Fixtures for tests/agents/daemon: the node daemon against a fake controller (fake_controller.py), a
scripted task handler (scripted_tasks.py), real bwrap sandboxes and the tiny model's tokenizer.

The helpers are in tests/support (fake_controller, node_helpers, scripted_tasks).
No asyncio plugin: each test runs its scenario with `asyncio.run`; the fake controller serves from
its own thread. Waiting is always on a condition with a deadline (`until`, `FakeController.wait_for`).
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from support.fake_controller import FakeController
from support.node_helpers import TOKEN, tiny_dir


@pytest.fixture(scope="session")
def tokenizer():
    from rolloutd.agents.tokenizer import ChatTokenizer

    return ChatTokenizer(tiny_dir())


@pytest.fixture
def sandbox_dir(tmp_path, monkeypatch) -> Path:
    if shutil.which("bwrap") is None:
        pytest.skip("bwrap is not installed (bash .ci/system-packages.sh installs it)")
    path = tmp_path / "sandboxes"
    path.mkdir()
    monkeypatch.setenv("ROLLOUTD_SANDBOX_DIR", str(path))
    return path


@pytest.fixture
def controller():
    """`controller(spec, **kw)` starts a FakeController; all are stopped at teardown."""
    started: list[FakeController] = []

    def start(spec: dict, **kw: Any) -> FakeController:
        fake = FakeController(spec, token=TOKEN, **kw).start()
        started.append(fake)
        return fake

    yield start
    for fake in started:
        fake.stop()
