"""Nothing a tenant sends holds the controller's event loop: a batch is opened a bounded step at a time and never
past quotas.itemsPerJob (counted over the job's life), and a YAML alias bomb is refused while it is composed
(the real controller)."""
from __future__ import annotations

import re
import socket
import ssl
from urllib.parse import urlsplit

from support.tenancy_helpers import job, jobs_path, put_policy, tenant

from rolloutd.controller.server import HEAD_SECONDS

BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8))


def _batch_job(name: str, groups: int) -> dict:
    return job(name, samplesPerPrompt=8, batches={"groups": groups})


def test_a_batch_past_the_item_quota_is_refused_before_anything_opens(kube, admin):
    put_policy(admin, "qitems", quotas={"itemsPerJob": 100})
    with tenant(kube, "qitems") as t:
        assert t.post(jobs_path("qitems"), json=_batch_job("b", 200)).status_code == 201, "job"
        r = t.post(f"{jobs_path('qitems')}/b/batches", json={})
        assert r.status_code == 403 and "quotas.itemsPerJob" in r.text, r.text
        named = t.post(f"{jobs_path('qitems')}/b/batches", json={"prompts": [0] * 13})  # 104 rollouts
        assert named.status_code == 403 and "quotas.itemsPerJob" in named.text, named.text
        assert t.get(f"{jobs_path('qitems')}/b/batches/1").status_code == 404  # nothing was opened
        ok = t.post(f"{jobs_path('qitems')}/b/batches", json={"prompts": [0] * 12})  # 96 fit
        assert ok.status_code == 200 and ok.json()["openedGroups"] == 12, ok.text


def _long_lags(client) -> float:
    """How many samples of the controller's event loop lag were over half a second so far."""
    text = client.get("/metrics").text
    total = float(re.search(r"^rolloutd_event_loop_lag_seconds_count (\S+)$", text, re.M)[1])
    fast = float(re.search(r'^rolloutd_event_loop_lag_seconds_bucket\{le="0.5"\} (\S+)$', text, re.M)[1])
    return total - fast


def test_a_large_batch_opens_in_steps_that_leave_the_loop_free(kube, admin):
    assert admin.post(jobs_path("default"), json=_batch_job("big", 800)).status_code == 201
    before = _long_lags(admin)
    r = admin.post(f"{jobs_path('default')}/big/batches", json={}, timeout=120)
    assert r.status_code == 200 and r.json()["openedGroups"] == 800, r.text  # 6400 rollouts
    assert _long_lags(admin) == before  # opened at once, it held the loop for seconds (2.2 s on the last main)


def test_a_yaml_alias_bomb_is_refused_while_composing(kube, admin):
    put_policy(admin, "qbomb")
    with tenant(kube, "qbomb") as t:
        for _ in range(3):
            r = t.post(jobs_path("qbomb"), content=BOMB, headers={"Content-Type": "application/yaml"})
            assert r.status_code == 400 and "YAML aliases" in r.json()["message"], r.text
        r = t.patch(f"{jobs_path('qbomb')}/x", content=BOMB, params={"fieldManager": "t"},
                    headers={"Content-Type": "application/apply-patch+yaml"})
        assert r.status_code == 400 and "YAML aliases" in r.json()["message"], r.text


def _half_open(kube, first: bytes) -> ssl.SSLSocket:
    host, port = urlsplit(kube.url).hostname, urlsplit(kube.url).port
    ctx = ssl.create_default_context(cafile=str(kube.cert))
    sock = ctx.wrap_socket(socket.create_connection((host, port), timeout=5), server_hostname=host)
    sock.sendall(first)
    sock.settimeout(HEAD_SECONDS * 3)
    return sock


def test_connections_that_never_finish_a_request_head_are_closed(kube, admin):
    """Slowloris: a connection with no head, or half a head, is closed by the server (no token needed)."""
    socks = [_half_open(kube, b""), _half_open(kube, b"GET /healthz HTTP/1.1\r\nHost: x\r\n")]
    try:
        for sock in socks:
            try:
                assert sock.recv(1) == b""  # closed by the server; a timeout here means it held the socket
            except ConnectionResetError:
                pass
    finally:
        for sock in socks:
            sock.close()
    assert admin.get("/healthz").status_code == 200


def test_a_kept_alive_connection_that_stops_inside_its_next_head_is_closed(kube, admin):
    """The next head's first byte ends the keep-alive timer (uvicorn's): a connection that sent one whole request
    and then half a head held its socket for good, the head deadline timing only a connection's first."""
    sock = _half_open(kube, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:80]
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        try:
            while chunk := sock.recv(4096):  # the rest of the first answer, then the server's close
                assert not chunk.startswith(b"HTTP/"), "answered half a head"
        except ConnectionResetError:
            pass
    finally:
        sock.close()
    assert admin.get("/healthz").status_code == 200


def test_a_client_that_leaves_inside_its_body_gets_a_400_not_a_traceback(kube, admin):
    """A body cut short (the client left, or the body deadline closed it) was `ClientDisconnect` escaping to uvicorn:
    80 lines of traceback in the controller's log per cut request, which any token holder could repeat."""
    log = kube.data_dir.parent / f"controller-{kube.port}.log"
    before = log.read_text().count("Exception in ASGI application")
    head = (f"POST {jobs_path('default')} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {kube.token}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    for _ in range(3):
        sock = _half_open(kube, head.encode() + b'{"kind": "RolloutJob", ')
        sock.close()
    with kube.client() as probe:  # a request after the three on their own connections: they were handled before it
        assert probe.get("/healthz").status_code == 200
        metrics = probe.get("/metrics").text
    assert log.read_text().count("Exception in ASGI application") == before, log.read_text()[-3000:]
    assert not re.search(r'^rolloutd_api_requests_total\{code="500"', metrics, re.M)
