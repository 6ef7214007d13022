"""Fixtures of the tenancy suite: one real `rolloutd controller` per module, over https (kubectl sends a bearer
token only over TLS) and with no executor, as tests/controller/kube runs it, and the admin's client; and `served`, one
per store for the modules that play a node or a client sending values a store may not hold. The helpers the tests
share (a tenant's client, its job, the admin's policy write) are in tests/support/tenancy_helpers.py."""
from __future__ import annotations

import os

import pytest

from support.controller_process import ControllerProcess
from support.kube_controller import https_controller
from support.sim.noop import PLUGINS, HealthServer

ROWS = 4  # the dataset's prompts: a `noop_job` of up to 32 rollouts


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def served(request, tmp_path_factory):
    """(admin client, a dataset of ROWS rows, [a backend that is only healthy]) of one controller per store (local
    executor, plain http) for the module: a start is ~2 s; each test makes its own `noop_job` in it."""
    tmp = tmp_path_factory.mktemp("served")
    store = tmp / "rolloutd.db" if request.param == "sqlite" else request.getfixturevalue("pg_server").create_database()
    source = tmp / "rows.jsonl"
    source.write_text("".join(f'{{"id":"r{i}"}}\n' for i in range(ROWS)))
    health = HealthServer()  # the backend's /health: the items lease; nobody generates here
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")])),
           "ROLLOUTD_TOKENIZER_ROOTS": str(tmp)}
    ctl = ControllerProcess(tmp / "data", executors="local", extra_args=("--store", str(store)), env=env).start()
    try:
        with ctl.client() as api:
            yield api, source, health.urls[:1]
    finally:
        ctl.stop()
        health.close()


@pytest.fixture
def controller(served):
    return served[0]


@pytest.fixture(scope="module")
def kube(tmp_path_factory):
    c = https_controller(tmp_path_factory.mktemp("tenancy"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def admin(kube):
    with kube.client() as client:
        yield client


@pytest.fixture
def local_kube(tmp_path):
    """The same with the local executor: its reconcile admits a job's items (`nodes: 0`: the test is the daemon)."""
    c = https_controller(tmp_path, executors="local")
    yield c
    c.stop()
