"""`rolloutd operator --kubeconfig` against a second rolloutd controller (`--no-operator`), as it would run
against a real cluster: the jobs live on that API server, the operator's kopf handlers reconcile them, its
local executor's daemons and its scheduler do the work, and status and events go back through the API."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

from support.cluster import P, Cluster, job_doc, plugin_env
from support.waiting import wait_until

from rolloutd.controller.access.auth import create_scoped_token
from rolloutd.crds.kit.paths import DataDir

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


def kubeconfig(path: Path, server: str, token: str | None = None, token_file: Path | None = None) -> Path:
    user = {"token": token} if token else {"tokenFile": str(token_file)}
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "rolloutd",
        "clusters": [{"name": "api", "cluster": {"server": server}}],
        "users": [{"name": "op", "user": user}],
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


def write_token(path: Path, token: str) -> None:
    """As kubelet rotates a projected token: a new file renamed over the old one."""
    tmp = path.with_suffix(".new")
    tmp.write_text(token + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def test_the_operator_follows_a_rotated_token_file(tmp_path, tiny_engine):
    """The kubeconfig names a token file (in a pod: the service account's, which kubelet rewrites before the
    token expires). After the file gets a new token and the old one is revoked, the operator still runs,
    finishes and releases a job: its own writes send the new token, and kopf logs in again after a 401."""
    (tmp_path / "api").mkdir()
    (tmp_path / "op").mkdir()
    api = ApiServer(tmp_path / "api").start()
    tokens = DataDir(api.data_dir).tokens
    token_file = tmp_path / "token"
    first = create_scoped_token(tokens, "operator-1", read_only=False, namespaces=[])
    write_token(token_file, first.token)
    op = Operator(tmp_path / "op", kubeconfig(tmp_path / "kubeconfig", api.url, token_file=token_file), plugin_env())
    try:
        op.start()
        api.apply(job_doc("before", tiny_engine, limit=1, samples=2, nodes=1))
        assert api.wait_done("before")["status"]["counts"]["succeeded"] == 2

        second = create_scoped_token(tokens, "operator-2", read_only=False, namespaces=[])
        write_token(token_file, second.token)
        (tokens / "operator-1.json").unlink()  # revoked: the first token is refused from now on
        refused = api.api.get(f"{NS}", headers={"Authorization": f"Bearer {first.token}"})
        assert refused.status_code == 401, refused.text

        api.apply(job_doc("after", tiny_engine, limit=1, samples=2, nodes=1))
        final = api.wait_done("after")
        assert final["status"]["counts"]["succeeded"] == 2
        assert final["metadata"]["finalizers"] == ["rolloutd.io/release"]
        assert api.api.delete(f"{NS}/after").status_code == 200
        wait_until(lambda: api.api.get(f"{NS}/after").status_code == 404, 60,
                   "the operator to release the job with the rotated token")
    finally:
        op.stop()
        api.stop()
