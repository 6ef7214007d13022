"""The node checks again: a job stored under a looser policy meets the policy stored when its daemon registers
(a real `rolloutd node` against the real controller refuses to start a sandbox and fails the job naming the
field and the policy). And a tenant's trainer pauses or reloads only backends its namespace owns."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from support.tenancy_helpers import MERGE, POLICIES, job, jobs_path, put_policy, refused, tenant

from support.stub_llm import StubLLM
from support.waiting import wait_until

from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.crds.node import NODE_PROTOCOL


def _daemon(kube, key: str, credential: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ROLLOUTD_CONTROLLER": kube.url, "ROLLOUTD_JOB": key, "ROLLOUTD_CA_FILE": str(kube.cert),
           "ROLLOUTD_JOIN_TOKEN": credential}
    env.pop("ROLLOUTD_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "rolloutd.controller.main", "node", "--name", "n1"], env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_policy_tightened_after_apply_stops_the_job_on_the_node(local_kube):
    """With the local executor, so the reconcile admits the job's items (`nodes: 0`: the daemon is this test's)."""
    stub = StubLLM()  # a backend that answers, so the job's items lease (no engine: the model is not the subject)
    try:
        with local_kube.client() as admin:
            _tightened(local_kube, admin, stub.url)
    finally:
        stub.close()


def _tightened(kube, admin, backend: str) -> None:
    put_policy(admin, "tight", network=True, backends=[backend])
    spec = {"sandbox": {"network": True}, "agent": {"maxTurns": 1, "tools": ["submit"]},
            "llm": {"tokenizer": str(model_dir("tiny")), "backends": [{"url": backend}]}, "samplesPerPrompt": 1,
            "executor": {"kind": "local", "nodes": 0}}
    with tenant(kube, "tight") as t:
        assert t.post(jobs_path("tight"), json=job("j", **spec)).status_code == 201
    put_policy(admin, "tight", network=False, backends=[backend])  # the admin tightens the policy; the stored job is unchanged
    reg = admin.post(f"{jobs_path('tight')}/j/nodes/register",  # the admin token acts as any node
                     json={"job": "j", "name": "probe", "protocol": NODE_PROTOCOL})
    assert reg.status_code == 200 and reg.json()["policy"]["network"] is False, reg.text  # the policy stored now
    assert reg.json()["policyName"] == "TenantPolicy tight"
    probe = f"{jobs_path('tight')}/j/nodes/{reg.json()['nodeId']}"
    assert admin.post(f"{probe}/deregister", json={}).status_code == 200
    wait_until(lambda: admin.get(f"{jobs_path('tight')}/j").json()["status"].get("counts", {}).get("total"),
               timeout=60, what="the job's items admitted")
    credential = admin.post(f"{jobs_path('tight')}/j/nodes/credential").json()["credential"]
    done = _daemon(kube, "tight/j", credential)
    assert done.returncode == 2, done.stderr[-2000:]  # refused, not retried
    assert "spec.sandbox.network" in done.stderr and "TenantPolicy tight" in done.stderr, done.stderr[-2000:]
    # the rollout it leased comes back as a configuration failure (what fails a job) naming field and policy
    lines = [json.loads(x) for x in admin.get(f"{jobs_path('tight')}/j/trajectories").text.splitlines() if x.strip()]
    assert lines and all(t["failure"]["kind"] == "config" and t["reward"] is None for t in lines), lines
    assert "spec.sandbox.network" in lines[0]["failure"]["reason"] and "TenantPolicy tight" in lines[0]["failure"]["reason"]
    assert "sandbox" not in done.stderr.replace("spec.sandbox", ""), done.stderr  # none was started
    # the same spec written by the admin: unrestricted, the registration carries no policy
    assert admin.post(jobs_path("tight"), json=job("adm", **spec)).status_code == 201
    reg = admin.post(f"{jobs_path('tight')}/adm/nodes/register",
                     json={"job": "adm", "name": "probe", "protocol": NODE_PROTOCOL})
    assert reg.status_code == 200 and "policy" not in reg.json(), reg.text


def test_a_tenant_pauses_or_reloads_only_the_backends_its_namespace_owns(kube, admin):
    put_policy(admin, "own")
    policy = f"{jobs_path('own')}/j/policy"
    with tenant(kube, "own") as t:
        assert t.post(jobs_path("own"), json=job("j")).status_code == 201  # backend http://127.0.0.1:8000, shared
        for body in ({"version": 2}, {"version": 2, "pause": True}, {"version": 2, "pause": False, "weightsPath": "/w"}):
            refused(t.post(policy, json=body), "spec.llm.backends[0].url", "TenantPolicy own")
        assert t.get(policy).json()["version"] is None  # nothing was announced
        admin_too = admin.post(policy, json={"version": 2, "pause": True})  # the job is the tenant's, whoever asks
        assert admin_too.status_code == 403
        r = t.post(policy, json={"version": 3, "pause": False})  # a version tag alone touches no engine
        assert r.status_code == 200 and r.json()["version"] == 3, r.text
        assert admin.patch(f"{POLICIES}/own", json={"spec": {"ownedBackends": ["http://127.0.0.1:8000"]}},
                           headers=MERGE).status_code == 200
        r = t.post(policy, json={"version": 4, "pause": True})
        assert r.status_code == 200 and r.json()["version"] == 4, r.text


def test_a_tenant_adds_only_backends_its_policy_allows(kube, admin):
    put_policy(admin, "addb", backends=["http://127.0.0.1:8000"])
    with tenant(kube, "addb") as t:
        assert t.post(jobs_path("addb"), json=job("j")).status_code == 201
        refused(t.post(f"{jobs_path('addb')}/j/backends", json={"url": "http://127.0.0.1:9999"}), "url",
                "TenantPolicy addb")
        urls = [b["url"] for b in t.get(f"{jobs_path('addb')}/j/backends").json()["items"]]
        assert urls == ["http://127.0.0.1:8000"]


def test_a_policy_with_no_backends_allows_none_and_the_admin_stays_unlimited(kube, admin):
    """A tenant steering the service to call an address of its choosing (the controller itself, a private
    service) through `spec.llm.backends`: an empty list in its policy allows no URL at all."""
    put_policy(admin, "nob", backends=[])
    steer = [kube.url, "http://10.1.2.3:6443"]  # the controller itself, a private service
    with tenant(kube, "nob") as t:
        for url in steer:
            spec = {"llm": {"backends": [{"url": url}]}}
            refused(t.post(jobs_path("nob"), json=job("j", **spec)), "spec.llm.backends[0].url", "TenantPolicy nob")
        r = t.post(jobs_path("nob"), json=job("j", llm={"backends": [{"url": "http://127.0.0.1:8000"}]}))
        body = refused(r, "spec.llm.backends[0].url", "TenantPolicy nob")
        assert "lists none" in body["message"], body
        assert t.get(f"{jobs_path('nob')}/j").status_code == 404  # nothing stored
    # a backend the namespace owns is one it may use; the admin's own jobs name any backend
    assert admin.patch(f"{POLICIES}/nob", json={"spec": {"ownedBackends": ["http://127.0.0.1:8000"]}},
                       headers=MERGE).status_code == 200
    with tenant(kube, "nob", "tok-nob-2") as t:
        assert t.post(jobs_path("nob"), json=job("j")).status_code == 201
        refused(t.post(f"{jobs_path('nob')}/j/backends", json={"url": steer[1]}), "url", "TenantPolicy nob")
    assert admin.post(jobs_path("nob"), json=job("adm", llm={"backends": [{"url": steer[1]}]})).status_code == 201
