"""Fixtures for the Kubernetes-API tests: one real `rolloutd controller` per module, served over TLS (kubectl
and client-go send a bearer token only over TLS), a kubeconfig pointing at it, and a `kubectl` runner.

The controller runs with no executor, as in tests/controller: jobs stay Pending unless a test drives
their status through the status subresource, which is what an operator does."""
from __future__ import annotations

import base64
import importlib.util
import os
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from kube_helpers import WATCH_HISTORY  # noqa: E402
import kube_tools  # noqa: E402

_spec = importlib.util.spec_from_file_location("controller_fixtures", HERE.parent / "controller" / "conftest.py")
controller_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(controller_fixtures)
ControllerProcess = controller_fixtures.ControllerProcess


def self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return cert, key


def https_controller(base: Path, executors: str = "", env: dict[str, str] | None = None) -> ControllerProcess:
    """A running controller over https (`executors`: its executor kinds; `env`: added to its environment),
    its kubeconfig written beside it."""
    cert, key = self_signed(base)
    # inherited by the controller: ROLLOUTD_WATCH_HISTORY makes 410 reachable
    added = {"ROLLOUTD_WATCH_HISTORY": str(WATCH_HISTORY), **(env or {})}
    saved = {k: os.environ.get(k) for k in added}
    os.environ.update(added)
    c = ControllerProcess(base / "data", executors=executors,
                          extra_args=("--tls-cert-file", str(cert), "--tls-key-file", str(key)),
                          scheme="https", verify=ssl.create_default_context(cafile=str(cert)))
    try:
        c.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    c.cert = cert
    c.kubeconfig = base / "kubeconfig"
    c.kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "rolloutd",
        "clusters": [{"name": "rolloutd", "cluster": {
            "server": c.url, "certificate-authority-data": base64.b64encode(cert.read_bytes()).decode()}}],
        "users": [{"name": "rolloutd", "user": {"token": c.token}}],
        "contexts": [{"name": "rolloutd", "context": {"cluster": "rolloutd", "user": "rolloutd",
                                                      "namespace": "default"}}],
    }))
    return c


def kubectl_for(kube: ControllerProcess):
    """`run(*args)`: kubectl with `kube`'s kubeconfig; asserts success unless check=False."""
    binary = kube_tools.kubectl()
    env = {**os.environ, "KUBECONFIG": str(kube.kubeconfig), "HOME": str(kube.kubeconfig.parent)}

    def run(*args: str, input: str | None = None, timeout: float = 60, check: bool = True):
        r = subprocess.run([binary, *args], input=input, capture_output=True, text=True, env=env, timeout=timeout)
        if check:
            assert r.returncode == 0, f"kubectl {' '.join(args)}: {r.stderr}"
        return r

    run.binary, run.env = binary, env
    return run


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
    """The local executor, with the benchmarks' task plug-ins (sim/plugins: bench-noop) on the controller's
    and so its daemons' PYTHONPATH: a real job that needs no LLM."""
    from sim.noop import PLUGINS

    plugins = str(PLUGINS)
    path = os.pathsep.join(filter(None, [plugins, os.environ.get("PYTHONPATH")]))
    c = https_controller(tmp_path_factory.mktemp("kube-plugins"), executors="local", env={"PYTHONPATH": path})
    yield c
    c.stop()
