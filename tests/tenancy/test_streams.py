"""Every long-lived answer of a namespace token counts as a watch (quotas.watches): a following trajectory stream,
a waiting batch read and the web UI's live stream as much as `?watch=true`; and a revoked token's open stream
ends (the real controller, real connections)."""
from __future__ import annotations

import time

import httpx

from support.tenancy_helpers import job, jobs_path, put_policy

from rolloutd.controller.access.auth import create_scoped_token
from rolloutd.crds.kit.paths import DataDir


def _token(kube, namespace: str, name: str) -> str:
    return create_scoped_token(DataDir(kube.data_dir).tokens, name, read_only=False, namespaces=[namespace]).token


def _follow(client, namespace: str, name: str):
    cm = client.stream("GET", f"{jobs_path(namespace)}/{name}/trajectories",
                       params={"follow": "true", "timeoutSeconds": "120"})
    return cm, cm.__enter__()


def test_follows_waits_and_ui_streams_count_as_watches(kube, admin):
    put_policy(admin, "qstream", quotas={"watches": 1})
    with kube.client(_token(kube, "qstream", "tok-qstream")) as t:
        assert t.post(jobs_path("qstream"), json=job("a")).status_code == 201
        cm, first = _follow(t, "qstream", "a")
        assert first.status_code == 200
        try:
            over = [
                t.get(f"{jobs_path('qstream')}/a/trajectories", params={"follow": "true", "timeoutSeconds": "1"}),
                t.get(f"{jobs_path('qstream')}/a/batches/0", params={"wait": "true", "timeoutSeconds": "1"}),
                t.get(jobs_path("qstream"), params={"watch": "true", "timeoutSeconds": "1"}),
                t.get("/ui/api/jobs/qstream/a/stream"),
            ]
            for r in over:
                assert r.status_code == 429 and "quotas.watches" in r.text, (r.request.url, r.text)
            assert t.get(f"{jobs_path('qstream')}/a/trajectories").status_code == 200  # a read is no stream
        finally:
            cm.__exit__(None, None, None)


def test_a_revoked_tokens_open_stream_ends(kube, admin):
    put_policy(admin, "qrevoke", quotas={"watches": 4})
    tokens = DataDir(kube.data_dir).tokens
    with kube.client(_token(kube, "qrevoke", "tok-qrevoke")) as t:
        assert t.post(jobs_path("qrevoke"), json=job("a")).status_code == 201
        with t.stream("GET", f"{jobs_path('qrevoke')}/a/trajectories",
                      params={"follow": "true", "timeoutSeconds": "120"}) as r:
            assert r.status_code == 200
            (tokens / "tok-qrevoke.json").unlink()  # what `rolloutctl token revoke` does
            start = time.monotonic()
            for _ in r.iter_bytes():  # the server ends the stream; the 120 s the client asked for never pass
                assert time.monotonic() - start < 60
        assert time.monotonic() - start < 60


def _anonymous(kube) -> httpx.Client:
    return httpx.Client(base_url=kube.url, timeout=30, verify=kube.verify)


def _login(kube, token: str) -> str:
    with _anonymous(kube) as anon:
        r = anon.post("/ui/login", data={"token": token}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == "/ui/jobs", r.text
        return r.cookies["rolloutd_session"]


def test_a_tenants_logins_end_only_its_own_oldest_sessions(kube, admin):
    from rolloutd.controller.ui.session import SESSIONS_PER_PRINCIPAL
    token = _token(kube, "qlogin", "tok-qlogin")
    admins = _login(kube, kube.token)
    first = _login(kube, token)
    for _ in range(SESSIONS_PER_PRINCIPAL):
        _login(kube, token)
    with _anonymous(kube) as anon:
        def status(sid: str) -> int:
            return anon.get("/ui/api/jobs", cookies={"rolloutd_session": sid}).status_code
        assert status(first) == 401  # the tenant's oldest session made room for its newest
        assert status(admins) == 200  # the admin's session is not the tenant's to end
