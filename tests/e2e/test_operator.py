"""`rolloutd operator --kubeconfig` against a second rolloutd controller (`--no-operator`), as it would run
against a real cluster: the jobs live on that API server, the operator's kopf handlers reconcile them, its
local executor's daemons and its scheduler do the work, and status and events go back through the API."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from cluster import P, Cluster, job_doc, plugin_env  # tests/e2e/cluster.py (on sys.path via conftest)
from waiting import wait_until

pytestmark = pytest.mark.timeout(660)
NS = P + "/namespaces/default/rolloutjobs"


class ApiServer(Cluster):
    """Stores and serves RolloutJobs; reconciles nothing (no executor, no embedded operator)."""

    executors = ""

    def argv(self) -> list[str]:
        return super().argv() + ["--no-operator"]


class Operator(Cluster):
    """`rolloutd operator`: the handlers against `kubeconfig`'s server, the scheduler and daemons here."""

    def __init__(self, root: Path, kubeconfig: Path, env: dict[str, str]):
        super().__init__(root, env)
        self.kubeconfig = kubeconfig

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "rolloutd.controller.main", "operator", "--kubeconfig", str(self.kubeconfig),
                "--data-dir", str(self.data_dir), "--port", str(self.port), "--executors", "local",
                "--log-level", "info"]


def kubeconfig(path: Path, server: str, token: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "rolloutd",
        "clusters": [{"name": "api", "cluster": {"server": server}}],
        "users": [{"name": "op", "user": {"token": token}}],
        "contexts": [{"name": "rolloutd", "context": {"cluster": "api", "user": "op", "namespace": "default"}}]}))
    return path


@pytest.fixture
def pair(tmp_path):
    (tmp_path / "api").mkdir()
    (tmp_path / "op").mkdir()
    api = ApiServer(tmp_path / "api").start()
    op = Operator(tmp_path / "op", kubeconfig(tmp_path / "kubeconfig", api.url, api.token), plugin_env())
    try:
        yield api, op.start()
    finally:
        op.stop()
        api.stop()


def test_operator_runs_a_job_stored_on_another_api_server(pair, tiny_engine):
    api, op = pair
    api.apply(job_doc("op-job", tiny_engine, limit=2, samples=2, nodes=1))
    final = api.wait_done("op-job")  # the status on the API server, written by the operator
    st = final["status"]
    assert st["counts"]["succeeded"] == 4
    assert {c["type"]: c["reason"] for c in st["conditions"]}["ExecutorReady"] == "Configured"  # not the API's own
    def reasons() -> list[str]:  # events are posted right after the status they tell of
        return [e["reason"] for e in api.api.get(f"{P}/rolloutjobs/op-job/events").json()["items"]]

    wait_until(lambda: "Succeeded" in reasons(), 30, "the operator's Succeeded event on the API server")
    phases = [r for r in reasons() if r in ("Provisioning", "Running", "Succeeded")]
    # Running is told only when an observation finds the job running: a job this small may be done first
    assert phases in (["Provisioning", "Running", "Succeeded"], ["Provisioning", "Succeeded"]), phases
    assert len(op.trajectories("op-job")) == 4  # the trainer API beside the handlers serves the results
    assert api.get("op-job")["metadata"]["finalizers"] == ["rolloutd.io/release"]

    assert api.api.delete(f"{NS}/op-job").status_code == 200
    wait_until(lambda: api.api.get(f"{NS}/op-job").status_code == 404, 60,
               "the operator to release the job and drop its finalizer on the API server")
    wait_until(lambda: op.api.get(f"{NS}/op-job").status_code == 404, 30, "the operator's local copy to go")
    assert "kopf" not in (api.root / "controller.log").read_text()  # --no-operator: the API server ran none
