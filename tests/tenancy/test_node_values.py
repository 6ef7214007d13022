"""Numbers a node daemon sends that no column can hold are refused with a 422 naming their field, on both stores
(the real controller process): never a 500 at every retry."""
from __future__ import annotations

import os
import secrets

import pytest

from support.controller_process import ControllerProcess
from support.sim.noop import PLUGINS, HealthServer, noop_job
from support.waiting import wait_until

from rolloutd.crds.node import NODE_PROTOCOL

P = "/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs"
ROLLOUTS = 16


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def served(request, tmp_path_factory):
    """One controller per store for the module (a start is ~2 s); each test has its own job in it."""
    tmp = tmp_path_factory.mktemp("values")
    store = tmp / "rolloutd.db" if request.param == "sqlite" else request.getfixturevalue("pg_server").create_database()
    source = tmp / "rows.jsonl"
    source.write_text("".join(f'{{"id":"r{i}"}}\n' for i in range(ROLLOUTS // 8)))
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


@pytest.fixture
def job(served) -> str:
    """A fresh job of ROLLOUTS rollouts in the module's controller, named for this test alone."""
    api, source, backends = served
    name = "val-" + secrets.token_hex(4)
    assert api.post(P, json=noop_job(name, source, ROLLOUTS, backends)).status_code == 201
    return name


def _register(api, job: str, **fields):
    return api.post(f"{P}/{job}/nodes/register",
                    json={"job": f"default/{job}", "name": "b0", "protocol": NODE_PROTOCOL, **fields})


@pytest.mark.parametrize("field", ["pid", "slot", "slurmNodeId"])
def test_a_register_number_no_32_bit_column_holds_is_refused_naming_it(controller, job, field):
    """2^40 was a 500 on PostgreSQL (an int4 column), stored on SQLite; 10^30 was already refused (past int64)."""
    for value in (2**40, 10**30, -1):
        r = _register(controller, job, **{field: value})
        assert r.status_code == 422, (value, r.status_code, r.text)
        assert [c["field"] for c in r.json()["details"]["causes"]] == [field], r.text
    r = _register(controller, job, **{field: 2**31 - 1})  # the largest a column holds is stored
    assert r.status_code == 200, r.text
    nodes = controller.get(f"/ui/api/jobs/default/{job}/nodes").json()
    assert nodes["items"] and controller.get(f"{P}/{job}").status_code == 200, nodes
