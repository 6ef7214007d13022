"""Node credentials per job, played as a hostile tenant against a real controller and its real local daemons.

Two jobs in two namespaces (team-a/alpha, team-b/beta) get their daemons from the local executor. The attacker
holds what a daemon of alpha holds: the credential in its environment (read from /proc, as anyone who owns the
node could). With it, nothing of beta may be reached, and no node of alpha may be impersonated; a namespace
token may not speak the node protocol at all; a released job's credential dies. The jobs' backend is a port
nobody listens on, so no work is leased and the jobs stay Running while the tests attack them. The last test
runs a job end to end with a stub backend (no engine): its daemon works with the new credentials.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support.cluster import P, REPO, Cluster, free_port
from support.stub_llm import StubLLM

from rolloutd.agents.engine.model_dirs import model_dir  # noqa: E402
from rolloutd.controller.access.auth import create_scoped_token  # noqa: E402
from rolloutd.crds.node import NODE_PROTOCOL  # noqa: E402

A, B = ("team-a", "alpha"), ("team-b", "beta")
VERBS = ("lease", "heartbeat", "results", "return", "deregister")
BODIES = {"lease": {"maxItems": 1}, "heartbeat": {}, "results": {"results": []}, "return": {"attemptIds": []},
          "deregister": {}}
REGISTER = {"protocol": NODE_PROTOCOL, "name": "intruder", "host": "h", "pid": 1}


def ns_path(job: tuple[str, str], *rest: str) -> str:
    return "/".join([f"{P}/namespaces/{job[0]}/rolloutjobs/{job[1]}", *rest])


def job_doc(name: str, backend: str, *, limit: int = 40, executor: str = "local") -> dict:
    return {
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name},
        "spec": {
            "tasks": {"kind": "math", "source": str(REPO / "examples" / "math" / "train.jsonl"), "limit": limit},
            "samplesPerPrompt": 2,
            "agent": {"maxTurns": 1, "tools": ["submit"],
                      "sampling": {"temperature": 1.0, "maxTokensPerTurn": 4, "maxTotalTokens": 512, "seed": 3}},
            "llm": {"tokenizer": str(model_dir("tiny")), "backends": [{"url": backend}]},
            "sandbox": {"runtime": "bwrap", "image": "host", "network": False,
                        "limits": {"memoryMB": 1024, "processes": 256, "wallSeconds": 120}},
            "executor": {"kind": executor, "nodes": 1},
            "pipeline": {"workersPerNode": {"init": 2, "run": 2, "eval": 2}},
            "timeouts": {"initSeconds": 60, "runSeconds": 60, "evalSeconds": 60, "actionSeconds": 20},
        },
    }


def wait(pred, what: str, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise TimeoutError(what)


def daemon_credential(cluster: Cluster, key: str) -> str:
    """What the job's daemon holds: ROLLOUTD_JOIN_TOKEN in its environment."""
    def read():
        try:
            state = json.loads((cluster.data_dir / "local-executor.json").read_text())
            pid = state[key]["0"]["pid"]
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError, KeyError):
            return None
        return next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"ROLLOUTD_JOIN_TOKEN=")), None)
    return wait(read, f"the daemon of {key} and its credential")


def node_of(cluster: Cluster, key: str) -> str:
    def read():
        with cluster.db() as db:
            row = db.execute("SELECT id FROM nodes WHERE job = ? AND state = 'active'", (key,)).fetchone()
        return row and row[0]
    return wait(read, f"a registered node of {key}")


def post(cluster: Cluster, path: str, token: str, body: dict) -> httpx.Response:
    return httpx.post(cluster.url + path, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def register(cluster: Cluster, job: tuple[str, str], token: str, name: str = "intruder") -> dict:
    r = post(cluster, ns_path(job, "nodes", "register") + "?features=node-token", token,
             {**REGISTER, "job": f"{job[0]}/{job[1]}", "name": name})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def two_teams(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("tenancy-nodes")).start()
    dead = f"http://127.0.0.1:{free_port()}"  # no backend answers: nothing is leased, the jobs stay Running
    try:
        for ns, name in (A, B):
            r = cluster.api.post(f"{P}/namespaces/{ns}/rolloutjobs", json=job_doc(name, dead))
            assert r.status_code == 201, r.text
        yield cluster
    finally:
        cluster.stop()


def test_a_job_credential_registers_for_its_own_job_only(two_teams):
    cred_a = daemon_credential(two_teams, "team-a/alpha")
    node_of(two_teams, "team-b/beta")
    for path, job in ((ns_path(B, "nodes", "register"), "team-b/beta"), (f"{P}/nodes/register", "team-b/beta"),
                      (ns_path(A, "nodes", "register"), "team-b/beta")):
        r = post(two_teams, path + "?features=node-token", cred_a, {**REGISTER, "job": job})
        assert r.status_code in (400, 401, 403), (path, r.text)
        assert "spec" not in r.json(), "beta's spec (its sandbox.env secrets) reached alpha's credential"
    with two_teams.db() as db:
        assert db.execute("SELECT count(*) FROM nodes WHERE name = 'intruder'").fetchone()[0] == 0


def test_a_job_credential_cannot_act_on_another_jobs_nodes(two_teams):
    cred_a = daemon_credential(two_teams, "team-a/alpha")
    beta_node = node_of(two_teams, "team-b/beta")
    for verb in VERBS:
        for path in (ns_path(B, "nodes", beta_node, verb), f"{P}/nodes/{beta_node}/{verb}",
                     ns_path(A, "nodes", beta_node, verb)):
            r = post(two_teams, path, cred_a, BODIES[verb])
            assert r.status_code in (401, 403, 404), (path, r.status_code, r.text)
    with two_teams.db() as db:
        assert db.execute("SELECT state FROM nodes WHERE id = ?", (beta_node,)).fetchone()[0] == "active"


def test_a_namespace_token_cannot_use_the_node_protocol(two_teams):
    team_a = create_scoped_token(two_teams.data_dir / "tokens", "team-a-nodes", read_only=False,
                                 namespaces=["team-a"]).token
    alpha_node = node_of(two_teams, "team-a/alpha")
    r = post(two_teams, ns_path(A, "nodes", "register") + "?features=node-token", team_a,
             {**REGISTER, "job": "team-a/alpha"})
    assert r.status_code == 403 and "node protocol" in r.json()["message"], r.text
    for verb in VERBS:
        r = post(two_teams, ns_path(A, "nodes", alpha_node, verb), team_a, BODIES[verb])
        assert r.status_code == 403, (verb, r.text)


def test_only_the_admin_hands_out_a_job_credential(two_teams):
    """For daemons started by hand: `rolloutd node-credential` (the admin token) prints the job's credential;
    neither a namespace token nor a node credential gets one."""
    cred_a = daemon_credential(two_teams, "team-a/alpha")
    team_a = create_scoped_token(two_teams.data_dir / "tokens", "team-a-creds", read_only=False,
                                 namespaces=["team-a"]).token
    assert post(two_teams, ns_path(A, "nodes", "credential"), team_a, {}).status_code == 403
    assert post(two_teams, ns_path(A, "nodes", "credential"), cred_a, {}).status_code == 401
    assert post(two_teams, ns_path(B, "nodes", "credential"), cred_a, {}).status_code == 401
    out = subprocess.run([sys.executable, "-m", "rolloutd.controller.main", "node-credential", "alpha", "-n", "team-a",
                          "--controller", two_teams.url, "--token-file", str(two_teams.data_dir / "token")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == cred_a, out.stderr


def test_a_node_acts_only_as_itself(two_teams):
    cred_a = daemon_credential(two_teams, "team-a/alpha")
    one, two = register(two_teams, A, cred_a, "n1"), register(two_teams, A, cred_a, "n2")
    assert one["nodeToken"] and one["nodeToken"] != two["nodeToken"] and cred_a not in (one["nodeToken"],)
    for verb in VERBS:  # node 1's token on node 2's paths, and the job credential on any node's path
        for token in (one["nodeToken"], cred_a):
            for path in (ns_path(A, "nodes", two["nodeId"], verb), f"{P}/nodes/{two['nodeId']}/{verb}"):
                r = post(two_teams, path, token, BODIES[verb])
                assert r.status_code == 401, (verb, path, r.text)
    r = post(two_teams, ns_path(A, "nodes", two["nodeId"], "heartbeat"), two["nodeToken"], {})
    assert r.status_code == 200, r.text  # node 2 is still registered, and its own token works
    r = post(two_teams, f"{P}/nodes/{one['nodeId']}/deregister", one["nodeToken"], {})
    assert r.status_code == 200, r.text


def test_node_tokens_survive_a_controller_restart(two_teams):
    cred_a = daemon_credential(two_teams, "team-a/alpha")
    node = register(two_teams, A, cred_a, "survivor")
    two_teams.kill()
    two_teams.start()
    r = post(two_teams, ns_path(A, "nodes", node["nodeId"], "heartbeat"), node["nodeToken"], {})
    assert r.status_code == 200, r.text
    assert daemon_credential(two_teams, "team-a/alpha") == cred_a  # the adopted daemon keeps its credential


def test_release_revokes_the_credential_and_a_recreated_job_gets_a_new_one(two_teams):
    cred_b = daemon_credential(two_teams, "team-b/beta")
    node = register(two_teams, B, cred_b, "leftover")
    r = two_teams.api.delete(ns_path(B))
    assert r.status_code in (200, 202), r.text
    wait(lambda: two_teams.api.get(ns_path(B)).status_code == 404, "beta deleted")
    r = post(two_teams, ns_path(B, "nodes", "register") + "?features=node-token", cred_b,
             {**REGISTER, "job": "team-b/beta"})
    assert r.status_code == 401, r.text
    r = post(two_teams, ns_path(B, "nodes", node["nodeId"], "heartbeat"), node["nodeToken"], {})
    assert r.status_code == 401, r.text
    r = two_teams.api.post(f"{P}/namespaces/team-b/rolloutjobs", json=job_doc("beta", "http://127.0.0.1:9"))
    assert r.status_code == 201, r.text
    assert wait(lambda: (c := daemon_credential(two_teams, "team-b/beta")) != cred_b and c, "a new credential")


def test_a_local_job_runs_end_to_end_with_its_own_credentials(tmp_path):
    stub = StubLLM()
    cluster = Cluster(tmp_path).start()
    try:
        doc = job_doc("solo", stub.url, limit=3)
        cluster.apply(doc)
        cluster.wait_done("solo", timeout=240)
        assert len(cluster.trajectories("solo")) == 6
        assert not (cluster.data_dir / "join-token").exists()  # no controller-wide join token any more
    finally:
        cluster.stop()
        stub.close()


def test_a_node_reports_only_the_rollouts_leased_to_it(tmp_path):
    """In-process app and scheduler (tests/support/node_api.py): node 1, with its own token, names a rollout
    leased to node 2 in its results; it is dropped, and node 2's own report of it is accepted."""
    from support.node_api import NODES, node_api, result

    with node_api(tmp_path) as (api, _):
        def reg(name: str) -> dict:
            r = api.post(f"{NODES}/register?features=node-token", headers={"Authorization": "Bearer admin"},
                         json={"job": "math-demo", "protocol": NODE_PROTOCOL, "name": name})
            assert r.status_code == 200, r.text
            return r.json()
        one, two = reg("n1"), reg("n2")
        as_one, as_two = ({"Authorization": f"Bearer {n['nodeToken']}"} for n in (one, two))
        r = api.post(f"{NODES}/{two['nodeId']}/lease", json={"maxItems": 1}, headers=as_two)
        [lease] = r.json()["leases"]
        forged = api.post(f"{NODES}/{one['nodeId']}/results", headers=as_one,
                          json={"results": [result(lease["attemptId"], reward=1.0)]}).json()
        assert forged["accepted"] == [] and lease["attemptId"] in forged["dropped"]
        own = api.post(f"{NODES}/{two['nodeId']}/results", headers=as_two,
                       json={"results": [result(lease["attemptId"], reward=0.0)]}).json()
        assert own["accepted"] == [lease["attemptId"]]


class _NoExecutor(Cluster):
    executors = ""  # no executor mints or revokes: only the admin's credential route does


def test_a_credential_of_an_earlier_job_of_the_same_name_registers_nothing(tmp_path):
    cluster = _NoExecutor(tmp_path).start()
    try:
        doc = job_doc("again", "http://127.0.0.1:9")
        cluster.apply(doc)
        r = cluster.api.post(f"{P}/namespaces/default/rolloutjobs/again/nodes/credential")
        assert r.status_code == 200, r.text
        old = r.json()["credential"]
        register(cluster, ("default", "again"), old)
        assert cluster.api.delete(f"{P}/rolloutjobs/again").status_code in (200, 202)
        wait(lambda: cluster.api.get(f"{P}/rolloutjobs/again").status_code == 404, "the job deleted")
        cluster.apply(doc)
        r = post(cluster, ns_path(("default", "again"), "nodes", "register") + "?features=node-token", old,
                 {**REGISTER, "job": "again"})
        assert r.status_code == 403 and "earlier" in r.json()["message"], r.text
    finally:
        cluster.stop()


def test_a_daemon_started_by_hand_serves_its_job_and_leaves_cleanly_when_the_job_is_released(tmp_path):
    """`rolloutd node` with the credential the admin fetched, for a job whose executor starts no daemon
    (`nodes: 0`): it registers; when the job is deleted its token is revoked and it exits 0 (not 1, 'lost')."""
    import os

    cluster = Cluster(tmp_path).start()
    daemon = None
    try:
        doc = job_doc("byo", "http://127.0.0.1:9")
        doc["spec"]["executor"]["nodes"] = 0
        cluster.apply(doc)
        cred = subprocess.run([sys.executable, "-m", "rolloutd.controller.main", "node-credential", "byo",
                               "--controller", cluster.url, "--token-file", str(cluster.data_dir / "token")],
                              capture_output=True, text=True, timeout=60).stdout.strip()
        env = {**os.environ, "ROLLOUTD_CONTROLLER": cluster.url, "ROLLOUTD_JOB": "byo", "ROLLOUTD_JOIN_TOKEN": cred}
        log = open(tmp_path / "byo-node.log", "wb")
        daemon = subprocess.Popen([sys.executable, "-m", "rolloutd.controller.main", "node", "--name", "byo-1"],
                                  env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        node_of(cluster, "byo")
        assert cluster.api.delete(f"{P}/rolloutjobs/byo").status_code in (200, 202)
        assert daemon.wait(timeout=90) == 0, (tmp_path / "byo-node.log").read_text()[-2000:]
    finally:
        if daemon is not None and daemon.poll() is None:
            daemon.kill()
        cluster.stop()
