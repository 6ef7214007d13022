"""The controller over https with a self-signed certificate, and everyone trusting it through a CA file:
kubectl (`--certificate-authority`), a real local-executor job whose node daemons register and report over
https (the controller hands them its CA as ROLLOUTD_CA_FILE), and the trainer client (ROLLOUTD_CA_FILE).
Without the CA each of them refuses the connection: the certificate is checked, not ignored."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support import kube_tools
from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.client import RolloutClient, RolloutdError
from support.sim.noop import HealthServer, noop_job as _job



def _kubeconfig(kube, path: Path) -> Path:
    """A kubeconfig naming the server and token but no CA: kubectl gets it from --certificate-authority."""
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": kube.url}}],
        "users": [{"name": "u", "user": {"token": kube.token}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": "default"}}]}))
    return path


def test_a_job_runs_end_to_end_over_https(plugin_kube, tmp_path, monkeypatch):
    kube = plugin_kube
    kubeconfig = _kubeconfig(kube, tmp_path / "kubeconfig")
    ca = f"--certificate-authority={kube.cert}"

    def kubectl(*args, input=None, check=True, timeout=60):
        r = subprocess.run([kube_tools.kubectl(), "--kubeconfig", str(kubeconfig), *args], capture_output=True,
                           text=True, timeout=timeout, input=input)
        assert not check or r.returncode == 0, r.stderr
        return r

    backend = HealthServer()
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(f'{{"id":"r{i}"}}\n' for i in range(2)))
    job = _job("tls-job", source, 16, backend.urls[:1])  # 2 prompts × 8 samples of bench-noop
    job["spec"]["executor"]["nodes"] = 1  # a real `rolloutd node` process, started by the local executor
    job["spec"]["llm"]["tokenizer"] = str(model_dir("tiny"))  # the daemon loads it (`make setup` prepared it)
    try:
        refused = kubectl("get", "rj", check=False)
        assert refused.returncode != 0 and "certificate" in refused.stderr  # unknown CA: refused
        kubectl(ca, "apply", "-f", "-", input=yaml.safe_dump(job))
        # kubectl's own watch over https (one process, woken by the change), not a kubectl process per poll: those
        # took a core from the daemon the test waits for
        done = kubectl(ca, "wait", "rj/tls-job", "--for=jsonpath={.status.phase}=Succeeded", "--timeout=120s",
                       check=False, timeout=150)
        assert done.returncode == 0 and "condition met" in done.stdout, \
            (done.stdout, done.stderr, kubectl(ca, "get", "rj", "tls-job", "-o", "yaml", check=False).stdout)
        table = kubectl(ca, "get", "rj").stdout.splitlines()
        assert table[1].split()[:2] == ["tls-job", "Succeeded"]
    finally:
        backend.close()
    status = yaml.safe_load(kubectl(ca, "get", "rj", "tls-job", "-o", "yaml").stdout)["status"]
    assert status["counts"]["succeeded"] == 16 and status["rewardMean"] == 1.0
    node_log = next((kube.data_dir / "logs").glob("tls-job-node*.log")).read_text()
    assert f"registered with {kube.url}" in node_log  # the daemon spoke https to the controller

    ctl = [sys.executable, "-m", "rolloutd.controller.ctl", "--server", kube.url]
    ctl_env = {**os.environ, "ROLLOUTD_TOKEN": kube.token, "ROLLOUTD_CONFIG": str(tmp_path / "no-config.yaml")}
    ctl_env.pop("ROLLOUTD_CA_FILE", None)
    refused = subprocess.run([*ctl, "get", "rj"], capture_output=True, text=True, env=ctl_env, timeout=60)
    assert refused.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr
    got = subprocess.run([*ctl, "--certificate-authority", str(kube.cert), "get", "rj", "tls-job", "-o", "json"],
                         capture_output=True, text=True, env=ctl_env, timeout=60)
    assert got.returncode == 0, got.stderr
    assert yaml.safe_load(got.stdout)["status"]["phase"] == "Succeeded"

    for var in ("ROLLOUTD_SERVER", "ROLLOUTD_TOKEN", "ROLLOUTD_CA_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ROLLOUTD_CONFIG", str(tmp_path / "no-config.yaml"))
    # the trainer client without the CA: the certificate is refused, at once (not retried as a restart would be)
    with pytest.raises(RolloutdError, match="does not trust"):
        with RolloutClient(kube.url, token=kube.token) as rc:
            rc.get("tls-job")
    monkeypatch.setenv("ROLLOUTD_CA_FILE", str(kube.cert))
    with RolloutClient(kube.url, token=kube.token) as rc:
        assert len(list(rc.trajectories("tls-job"))) == 16
