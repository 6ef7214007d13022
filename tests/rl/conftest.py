"""The RL example's tests: the trainer runs in the engine venv (torch), so they drive it as a
subprocess; the engine is the shared tiny one (tests/support/engine_fixtures.py). The verl and SkyRL tests
share one controller with the test task plug-ins (`trainer_cluster`)."""
from __future__ import annotations

import pytest

from support.cluster import Cluster, plugin_env
from support.engine_fixtures import engine_pool, tiny_engine  # noqa: F401


@pytest.fixture(scope="session")
def trainer_cluster(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("trainers"), env=plugin_env()).start()
    try:
        yield cluster
    finally:
        cluster.stop()
