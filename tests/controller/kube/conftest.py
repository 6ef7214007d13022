"""Fixtures for the Kubernetes-API tests: one real `rolloutd controller` per module, served over TLS (kubectl
and client-go send a bearer token only over TLS), a kubeconfig pointing at it, and a `kubectl` runner.

The controller runs with no executor, as in tests/controller: jobs stay Pending unless a test drives
their status through the status subresource, which is what an operator does."""
from __future__ import annotations

import os

import pytest

from support.kube_controller import https_controller, kubectl_for


@pytest.fixture(scope="module")
def kube(tmp_path_factory):
    """A running controller over https with no executor, its kubeconfig written beside it."""
    c = https_controller(tmp_path_factory.mktemp("kube"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def kubectl(kube):
    return kubectl_for(kube)


@pytest.fixture(scope="module")
def local_kube(tmp_path_factory):
    """The same with the local executor: jobs of `nodes: 0` run, their node simulated over the node protocol."""
    c = https_controller(tmp_path_factory.mktemp("kube-local"), executors="local")
    yield c
    c.stop()


@pytest.fixture(scope="module")
def local_kubectl(local_kube):
    return kubectl_for(local_kube)


@pytest.fixture(scope="module")
def plugin_kube(tmp_path_factory):
    """The local executor, with the benchmarks' task plug-ins (tests/support/sim/plugins: bench-noop) on the controller's
    and so its daemons' PYTHONPATH: a real job that needs no LLM."""
    from support.sim.noop import PLUGINS

    plugins = str(PLUGINS)
    path = os.pathsep.join(filter(None, [plugins, os.environ.get("PYTHONPATH")]))
    c = https_controller(tmp_path_factory.mktemp("kube-plugins"), executors="local", env={"PYTHONPATH": path})
    yield c
    c.stop()
