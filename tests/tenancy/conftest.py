"""Fixtures of the tenancy suite: one real `rolloutd controller` per module, over https (kubectl sends a bearer
token only over TLS) and with no executor, as tests/controller/kube runs it, and the admin's client. The helpers the tests
share (a tenant's client, its job, the admin's policy write) are in tests/support/tenancy_helpers.py."""
from __future__ import annotations

import pytest

from support.kube_controller import https_controller


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
