"""The TenantPolicy resource is the admin's: served cluster-scoped, written with kubectl and rolloutctl by the
admin token, refused (403) to every namespace token, which reads at most its own namespace's policy."""
from __future__ import annotations

import subprocess
import sys

import yaml
from support.tenancy_helpers import MERGE, POLICIES, job, jobs_path, kubectl_for, put_policy, refused, tenant
from support.kube_helpers import tenant_policy


def test_a_namespace_token_cannot_write_any_tenant_policy(kube, admin):
    put_policy(admin, "team-a")
    with tenant(kube, "team-a") as t:
        mine = tenant_policy("team-a", runtimes=["bwrap", "process"], network=True)
        for r in (t.put(f"{POLICIES}/team-a", json=mine), t.post(POLICIES, json=tenant_policy("team-new")),
                  t.patch(f"{POLICIES}/team-a", json={"spec": {"runtimes": ["process"]}}, headers=MERGE),
                  t.delete(f"{POLICIES}/team-a"), t.get(POLICIES), t.get(f"{POLICIES}/team-b")):
            assert r.status_code == 403, (r.request.method, r.request.url, r.text)
            assert r.json()["reason"] == "Forbidden" and "only the admin token" in r.json()["message"]
        own = t.get(f"{POLICIES}/team-a")  # its own namespace's policy: readable, so a tenant knows its limits
        assert own.status_code == 200 and own.json()["spec"]["runtimes"] == ["bwrap"]
        refused(t.post(jobs_path("team-a"), json=job("p", sandbox={"runtime": "process"})),
                "spec.sandbox.runtime", "TenantPolicy team-a")  # still the admin's policy


def test_the_admin_writes_reads_patches_and_deletes_a_policy_and_a_bad_one_is_422_naming_the_field(admin):
    created = admin.post(POLICIES, json=tenant_policy("team-c", network=True))
    assert created.status_code == 201, created.text
    assert admin.post(POLICIES, json=tenant_policy("team-c")).status_code == 409
    patched = admin.patch(f"{POLICIES}/team-c", json={"spec": {"network": False}}, headers=MERGE)
    assert patched.status_code == 200 and patched.json()["spec"]["network"] is False, patched.text
    assert "team-c" in [p["metadata"]["name"] for p in admin.get(POLICIES).json()["items"]]
    bad = admin.put(f"{POLICIES}/team-c", json=tenant_policy("team-c", dataRoots=["data/../../etc"]))
    assert bad.status_code == 422 and bad.json()["details"]["causes"][0]["field"].startswith("spec.dataRoots"), bad.text
    unknown = admin.put(f"{POLICIES}/team-c", json=tenant_policy("team-c", runtime=["process"]))
    assert unknown.status_code == 422 and unknown.json()["details"]["causes"][0]["field"] == "spec.runtime"
    assert admin.delete(f"{POLICIES}/team-c").status_code == 200
    assert admin.get(f"{POLICIES}/team-c").status_code == 404


def test_kubectl_applies_gets_and_deletes_a_tenant_policy(kube, tmp_path):
    kubectl = kubectl_for(kube)
    doc = tenant_policy("team-k")
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert "tenantpolicy.rolloutd.io/team-k created" in kubectl("apply", "-f", str(path)).stdout
    listed = kubectl("get", "tenantpolicies").stdout
    assert "team-k" in listed and "bwrap" in listed, listed
    doc["spec"]["network"] = True
    path.write_text(yaml.safe_dump(doc))
    assert "configured" in kubectl("apply", "-f", str(path)).stdout
    got = yaml.safe_load(kubectl("get", "tenantpolicy", "team-k", "-o", "yaml").stdout)
    assert got["spec"]["network"] is True
    assert "deleted" in kubectl("delete", "tenantpolicy", "team-k").stdout
    assert kubectl("get", "tenantpolicy", "team-k", check=False).returncode != 0


def test_rolloutctl_policy_apply_get_delete(kube, tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(tenant_policy("team-r", network=True)))
    base = [sys.executable, "-m", "rolloutd.controller.ctl", "--server", kube.url, "--certificate-authority",
            str(kube.cert), "--token-file", str(kube.data_dir / "token")]

    def ctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*base, "policy", *args], capture_output=True, text=True, timeout=60)

    r = ctl("apply", "-f", str(path))
    assert r.returncode == 0 and "team-r created" in r.stdout, r.stderr
    assert "team-r configured" in ctl("apply", "-f", str(path)).stdout
    got = yaml.safe_load(ctl("get", "team-r", "-o", "yaml").stdout)
    assert got["spec"]["network"] is True
    assert "team-r" in ctl("get").stdout
    assert ctl("delete", "team-r").returncode == 0
    gone = ctl("get", "team-r")
    assert gone.returncode == 1 and "404" in gone.stderr


def test_the_tenant_policy_crd_is_generated_from_the_model_and_valid():
    import kubernetes_validate

    from rolloutd.crds.crd import POLICY_CRD_PATH, build_policy_crd, render_policy_crd
    assert POLICY_CRD_PATH.read_text() == render_policy_crd(), "crds/tenantpolicy.yaml is stale: run `rolloutd crd`"
    kubernetes_validate.validate(build_policy_crd(), "1.33", strict=True)
    spec = build_policy_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert {"runtimes", "volumes", "dataRoots", "ownedBackends", "quotas"} <= set(spec)
