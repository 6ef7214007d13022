"""Fixtures of the tenancy suite: one real `rolloutd controller` per module, over https (kubectl sends a bearer
token only over TLS) and with no executor, as tests/kube runs it, and the admin's client. The helpers the tests
share (a tenant's client, its job, the admin's policy write) are in tenancy_helpers.py."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("kube_fixtures_for_tenancy", HERE.parent / "kube" / "conftest.py")
kube_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kube_fixtures)  # puts tests/ and tests/kube on sys.path
sys.path.insert(0, str(HERE))
https_controller = kube_fixtures.https_controller


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
