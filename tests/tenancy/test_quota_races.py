"""Quotas under parallel requests, and what is the operator's: 32 creates at once against the real controller
store no more jobs (or nodes) than the namespace's quota; a namespace token cannot write a job's status (the
phase the node quota counts) nor strip the release finalizer."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from support.tenancy_helpers import MERGE, job, jobs_path, put_policy, tenant

from rolloutd.controller.access.auth import create_scoped_token
from rolloutd.crds.kit.paths import DataDir

PARALLEL = 32


def _post_all(kube, namespace: str, docs: list[dict]) -> list[int]:
    """Every doc POSTed at once, each from its own connection (a barrier holds them until all are connected)."""
    token = create_scoped_token(DataDir(kube.data_dir).tokens, f"race-{namespace}", read_only=False,
                                namespaces=[namespace]).token
    clients = [kube.client(token) for _ in docs]
    try:
        for c in clients:
            assert c.get("/version").status_code == 200  # connected before the race starts
        with ThreadPoolExecutor(len(docs)) as pool:
            return list(pool.map(lambda cd: cd[0].post(jobs_path(namespace), json=cd[1]).status_code,
                                 zip(clients, docs)))
    finally:
        for c in clients:
            c.close()


def test_parallel_creates_store_no_more_jobs_than_the_quota(kube, admin):
    put_policy(admin, "racejobs", quotas={"jobs": 2, "nodes": 64})
    codes = _post_all(kube, "racejobs", [job(f"j{i}") for i in range(PARALLEL)])
    assert codes.count(201) == 2 and codes.count(403) == PARALLEL - 2, codes
    assert len(admin.get(jobs_path("racejobs")).json()["items"]) == 2


def test_parallel_creates_hold_no_more_nodes_than_the_quota(kube, admin):
    put_policy(admin, "racenodes", quotas={"jobs": 64, "nodes": 2})
    codes = _post_all(kube, "racenodes", [job(f"n{i}", executor={"nodes": 1}) for i in range(PARALLEL)])
    assert codes.count(201) == 2, codes
    items = admin.get(jobs_path("racenodes")).json()["items"]
    assert sum(i["spec"]["executor"]["nodes"] for i in items) == 2


def test_a_namespace_token_cannot_write_status_to_free_its_node_quota(kube, admin):
    put_policy(admin, "qstatus", quotas={"jobs": 8, "nodes": 1})
    with tenant(kube, "qstatus") as t:
        assert t.post(jobs_path("qstatus"), json=job("a", executor={"nodes": 1})).status_code == 201
        path = f"{jobs_path('qstatus')}/a/status"
        forged = {"status": {"phase": "Failed"}}
        for r in (t.patch(path, json=forged, headers=MERGE),
                  t.put(path, json={**t.get(path).json(), **forged})):
            assert r.status_code == 403 and "status" in r.json()["message"], r.text
        assert t.get(path).json()["status"].get("phase", "Pending") == "Pending"
        assert t.post(jobs_path("qstatus"), json=job("b", executor={"nodes": 1})).status_code == 403
        assert admin.patch(path, json={"status": {"phase": "Failed"}}, headers=MERGE).status_code == 200  # the operator's


def test_a_namespace_token_cannot_strip_the_release_finalizer(kube, admin):
    put_policy(admin, "qfinal")
    with tenant(kube, "qfinal") as t:
        assert t.post(jobs_path("qfinal"), json=job("a")).status_code == 201
        path = f"{jobs_path('qfinal')}/a"
        stripped = t.patch(path, json={"metadata": {"finalizers": None}}, headers=MERGE)
        assert stripped.status_code == 200, stripped.text
        assert "rolloutd.io/release" in admin.get(path).json()["metadata"]["finalizers"]  # the write kept it
        assert t.delete(path).status_code == 200
        # deleted: the operator releases it (its nodes) and only then removes the finalizer; the tenant's strip in
        # between keeps it too — unless the operator was quicker (the job then gone: 404, released, nothing skipped)
        stripped = t.patch(path, json={"metadata": {"finalizers": None}}, headers=MERGE)
        assert stripped.status_code in (200, 404), stripped.text
        if stripped.status_code == 200:
            held = admin.get(path)
            assert held.status_code == 404 or "rolloutd.io/release" in held.json()["metadata"]["finalizers"], held.text


def test_a_job_keeps_its_newest_events_only(kube, admin):
    from rolloutd.controller.store.db import EVENTS_PER_JOB
    put_policy(admin, "qevents")
    with tenant(kube, "qevents") as t:
        assert t.post(jobs_path("qevents"), json=job("a")).status_code == 201
        path = "/api/v1/namespaces/qevents/events"
        for i in range(EVENTS_PER_JOB + 10):
            r = t.post(path, json={"involvedObject": {"kind": "RolloutJob", "name": "a", "namespace": "qevents"},
                                   "reason": "Spam", "message": f"event {i}", "type": "Normal"})
            assert r.status_code == 201, r.text
        items = t.get(f"{jobs_path('qevents')}/a/events").json()["items"]
        assert len(items) == EVENTS_PER_JOB
        assert items[-1]["message"] == f"event {EVENTS_PER_JOB + 9}" and items[0]["message"] == "event 10"


def test_backend_calls_are_held_to_the_callers_policy_whoever_wrote_the_job(kube, admin):
    """An admin-written job in a tenant's namespace: the tenant's pause, reload and backend writes on it are
    still the tenant's (its policy owns no backend and allows only the shared one)."""
    put_policy(admin, "qcaller", backends=["http://127.0.0.1:8000"])
    assert admin.post(jobs_path("qcaller"), json=job("adm")).status_code == 201
    with tenant(kube, "qcaller") as t:
        base = f"{jobs_path('qcaller')}/adm"
        for body in ({"version": 2, "pause": True}, {"version": 2, "pause": False, "weightsPath": "/tmp/evil"}):
            r = t.post(f"{base}/policy", json=body)
            assert r.status_code == 403 and "ownedBackends" in r.text, r.text
        r = t.post(f"{base}/backends", json={"url": "http://127.0.0.1:9999"})
        assert r.status_code == 403 and "not allowed" in r.text, r.text
        assert [b["url"] for b in t.get(f"{base}/backends").json()["items"]] == ["http://127.0.0.1:8000"]


def test_a_tenant_sees_a_backend_it_does_not_own_as_up_or_down_only(kube, admin):
    from support.waiting import wait_until
    put_policy(admin, "qhealth")
    closed = "http://127.0.0.1:9"  # nothing listens: its probe fails with a reason naming why
    assert admin.post(jobs_path("qhealth"), json=job("j")).status_code == 201
    base = f"{jobs_path('qhealth')}/j/backends"
    assert admin.post(base, json={"url": closed}).status_code == 200

    def reason(client) -> str:
        return next(b for b in client.get(base).json()["items"] if b["url"] == closed)["reason"]
    wait_until(lambda: reason(admin), timeout=30, what="the closed backend probed")
    assert reason(admin) not in ("", "down")  # the admin sees why
    with tenant(kube, "qhealth") as t:
        assert reason(t) == "down"
