"""The quotas only the controller can count: RolloutJobs per namespace and nodes summed over its jobs (403 at
apply naming the field and the policy), and open watches of its tokens (429 past the quota, the slot given
back when a watch ends)."""
from __future__ import annotations

import time

import httpx
from support.tenancy_helpers import job, jobs_path, put_policy, refused, tenant


def test_the_jobs_quota_refuses_one_job_too_many(kube, admin):
    put_policy(admin, "qjobs", quotas={"jobs": 2, "nodes": 64})
    with tenant(kube, "qjobs") as t:
        assert t.post(jobs_path("qjobs"), json=job("a")).status_code == 201
        assert t.post(jobs_path("qjobs"), json=job("b")).status_code == 201
        body = refused(t.post(jobs_path("qjobs"), json=job("c")), "metadata.namespace", "TenantPolicy qjobs")
        assert "quotas.jobs" in body["message"]
        assert t.patch(f"{jobs_path('qjobs')}/a", json={"spec": {"priority": 3}},  # updates are not creations
                       headers={"Content-Type": "application/merge-patch+json"}).status_code == 200
        assert t.delete(f"{jobs_path('qjobs')}/a").status_code == 200


def test_the_nodes_quota_counts_every_live_job_of_the_namespace(kube, admin):
    put_policy(admin, "qnodes", quotas={"jobs": 8, "nodes": 3})
    with tenant(kube, "qnodes") as t:
        assert t.post(jobs_path("qnodes"), json=job("a", executor={"nodes": 2})).status_code == 201
        body = refused(t.post(jobs_path("qnodes"), json=job("b", executor={"nodes": 2})), "spec.executor.nodes",
                       "TenantPolicy qnodes")
        assert "quotas.nodes 3" in body["message"]
        assert t.post(jobs_path("qnodes"), json=job("b", executor={"nodes": 1})).status_code == 201


def _open_watch(client: httpx.Client, namespace: str):
    cm = client.stream("GET", jobs_path(namespace), params={"watch": "true", "timeoutSeconds": "60"})
    return cm, cm.__enter__()


def test_watches_over_the_quota_get_429_and_a_closed_watch_gives_its_slot_back(kube, admin):
    put_policy(admin, "qwatch", quotas={"watches": 2})
    with tenant(kube, "qwatch") as t:
        opened = [_open_watch(t, "qwatch") for _ in range(2)]
        assert [r.status_code for _, r in opened] == [200, 200]
        over = t.get(jobs_path("qwatch"), params={"watch": "true", "timeoutSeconds": "1"})
        assert over.status_code == 429, over.text
        assert over.json()["reason"] == "TooManyRequests" and "quotas.watches" in over.json()["message"]
        assert t.get(jobs_path("qwatch")).status_code == 200  # a list is no watch
        with admin.stream("GET", jobs_path("qwatch"), params={"watch": "true", "timeoutSeconds": "1"}) as r:
            assert r.status_code == 200  # the admin's watches are not the tenant's
        cm, _ = opened.pop()
        cm.__exit__(None, None, None)
        deadline, code = time.monotonic() + 20, 429
        while code == 429 and time.monotonic() < deadline:  # the server sees the disconnect on its next read
            code = t.get(jobs_path("qwatch"), params={"watch": "true", "timeoutSeconds": "0.2"}).status_code
        assert code == 200
        for cm, _ in opened:
            cm.__exit__(None, None, None)
