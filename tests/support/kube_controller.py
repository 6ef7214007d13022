"""A real `rolloutd controller` served over https (kubectl and client-go send a bearer token only over TLS),
its self-signed certificate and a kubeconfig written beside it, and `kubectl_for`: kubectl pointed at it.
The fixtures of tests/controller/kube and tests/tenancy start it. Next step: a CA of its own instead of a self-signed
leaf, to test rotation."""
from __future__ import annotations

import base64
import os
import ssl
import subprocess
from pathlib import Path

import yaml

from support import kube_tools
from support.controller_process import ControllerProcess
from support.kube_helpers import WATCH_HISTORY


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
