"""Login rate limits on a real controller (#36): failed token checks per client address end in 429 with
Retry-After, a valid token from the same address still gets in, and a tenant's logins spend only its own budget."""
from __future__ import annotations

import httpx
import pytest
from support.kube_controller import https_controller
from support.tenancy_helpers import tenant

from rolloutd.controller.http.login_limit import FAILURES_BURST, LOGINS_BURST

JOBS = "/apis/rolloutd.io/v1alpha1/namespaces/team-a/rolloutjobs"


@pytest.fixture
def kube(tmp_path):  # its own controller: the budgets spent here would leak into other tests' 401s
    c = https_controller(tmp_path)
    yield c
    c.stop()


def _anon(kube) -> httpx.Client:
    return httpx.Client(base_url=kube.url, timeout=30, verify=kube.verify, follow_redirects=False)


def _retry_after(r: httpx.Response) -> int:
    assert r.status_code == 429, (r.status_code, r.text)
    wait = int(r.headers["retry-after"])
    assert 1 <= wait <= 60, wait
    return wait


def test_failures_from_one_address_are_429_and_the_real_token_still_gets_in(kube):
    tenant_client = tenant(kube, "team-a")
    with _anon(kube) as anon:
        for i in range(FAILURES_BURST):  # a third party guessing from the admin's address (port-forward: 127.0.0.1)
            r = anon.post("/ui/login", data={"token": f"guess-{i}"})
            assert r.status_code == 303 and r.headers["location"] == "/ui/login?failed=1", r.text
        _retry_after(anon.post("/ui/login", data={"token": "guess-ui"}))
        # the budget is the address's, whichever door the guess comes through
        _retry_after(anon.get(JOBS, headers={"Authorization": "Bearer guess-api"}))
        _retry_after(anon.get("/ui/api/jobs", headers={"Authorization": "Bearer guess-ui-api"}))
        # no lockout: the real tokens are checked before the limit, and pass
        r = anon.post("/ui/login", data={"token": kube.token})
        assert r.status_code == 303 and r.headers["location"] == "/ui/jobs", r.text
        assert anon.get(JOBS, headers={"Authorization": f"Bearer {kube.token}"}).status_code == 200
        assert tenant_client.get(JOBS).status_code == 200
        # a request without any token is not a guess: still the plain 401
        assert anon.get(JOBS).status_code == 401


def test_a_tenants_logins_spend_its_own_budget_never_the_admins(kube):
    token = tenant(kube, "team-b", "tok-team-b").headers["authorization"].removeprefix("Bearer ")
    with _anon(kube) as anon:
        for _ in range(LOGINS_BURST):
            assert anon.post("/ui/login", data={"token": token}).status_code == 303
        _retry_after(anon.post("/ui/login", data={"token": token}))
        r = anon.post("/ui/login", data={"token": kube.token})
        assert r.status_code == 303 and r.headers["location"] == "/ui/jobs", r.text
