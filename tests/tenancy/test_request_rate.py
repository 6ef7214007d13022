"""A namespace token's request rate on a real controller (#36): over its TenantPolicy's rate a sequential client is
slowed to it (delayed, never refused), a concurrent flood past the few waiting gets 429 with Retry-After (before the
body is read, on node paths too), another tenant and the admin go on unmetered meanwhile, a policy's new rate applies
at once and a bad one is refused naming the field."""
from __future__ import annotations

import asyncio
import math
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from support.tenancy_helpers import POLICIES, jobs_path, put_policy, tenant
from support.waiting import wait_until

from rolloutd.controller.http.request_rate import DEFAULT_BURST, DEFAULT_RPS, MAX_WAITING


@pytest.fixture
def kube(tmp_path):  # its own controller: the buckets spent here stay here
    from support.kube_controller import https_controller
    c = https_controller(tmp_path)
    yield c
    c.stop()


@pytest.fixture
def admin(kube):
    with kube.client() as client:
        yield client


def _counter(admin: httpx.Client, name: str) -> float:
    for line in admin.get("/metrics").text.splitlines():
        if line.startswith(name + "_total "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_a_sequential_client_over_its_rate_is_slowed_to_it_and_a_new_rate_applies_at_once(kube, admin):
    burst, rps, n = 5, 10, 25
    put_policy(admin, "rate-a", quotas={"requestBurst": burst, "requestsPerSecond": rps})
    delayed = _counter(admin, "rolloutd_api_requests_delayed")
    with tenant(kube, "rate-a") as a:
        start = time.monotonic()
        codes = [a.get(jobs_path("rate-a")).status_code for _ in range(n)]
        took = time.monotonic() - start
        assert codes == [200] * n  # one at a time never has more than one waiting: slowed, not refused
        # the bucket lets `burst` go at once and one more every 1/rps s: the n-th cannot be answered sooner
        assert took >= (n - burst) / rps - 0.01, took
        assert _counter(admin, "rolloutd_api_requests_delayed") - delayed >= n - burst - math.ceil(took * rps)
        # the admin raises the rate: the next requests pass without waiting (no request is delayed any more)
        put_policy(admin, "rate-a", quotas={"requestBurst": 1000, "requestsPerSecond": 1000})
        delayed = _counter(admin, "rolloutd_api_requests_delayed")
        assert [a.get(jobs_path("rate-a")).status_code for _ in range(n)] == [200] * n
        assert _counter(admin, "rolloutd_api_requests_delayed") == delayed


async def _flood(kube, token: str, path: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=kube.url, verify=kube.verify, timeout=60,
                                 headers={"Authorization": f"Bearer {token}"},
                                 limits=httpx.Limits(max_connections=n, max_keepalive_connections=n)) as c:
        return await asyncio.gather(*(c.get(path) for _ in range(n)))


async def _sequential(client: httpx.Client, path: str, n: int) -> tuple[list[int], float]:
    def run() -> tuple[list[int], float]:
        start = time.monotonic()
        codes = [client.get(path).status_code for _ in range(n)]
        return codes, time.monotonic() - start
    return await asyncio.to_thread(run)


def test_a_concurrent_flood_past_the_queue_is_429_with_retry_after_and_others_are_not_metered(kube, admin):
    burst, rps, n, others = 2, 2, 40, 20
    put_policy(admin, "rate-b", quotas={"requestBurst": burst, "requestsPerSecond": rps})
    with tenant(kube, "rate-b") as flooder:
        token = flooder.headers["authorization"].removeprefix("Bearer ")
    refused = _counter(admin, "rolloutd_api_requests_rate_refused")
    with tenant(kube, "rate-c") as c:  # no policy of its own: the default rate

        async def main():
            start = time.monotonic()
            flood = asyncio.create_task(_flood(kube, token, jobs_path("rate-b"), n))
            other, mine = await asyncio.gather(_sequential(c, jobs_path("rate-c"), others),
                                               _sequential(admin, jobs_path("rate-b"), others))
            answers = await flood
            return answers, other, mine, time.monotonic() - start

        answers, other, mine, took = asyncio.run(main())
    codes = [r.status_code for r in answers]
    assert set(codes) <= {200, 429}, codes
    too_many = [r for r in answers if r.status_code == 429]
    # served: the burst, the few waiting, and what the bucket refilled while the flood lasted; the rest at once 429
    assert codes.count(200) <= burst + MAX_WAITING + math.ceil(rps * took), (codes, took)
    assert len(too_many) >= n - burst - MAX_WAITING - math.ceil(rps * took) and too_many, (codes, took)
    for r in too_many:
        assert 1 <= int(r.headers["retry-after"]) <= math.ceil((MAX_WAITING + 1) / rps), r.headers
        assert r.json()["reason"] == "TooManyRequests" and "requestsPerSecond" in r.json()["message"], r.text
    assert _counter(admin, "rolloutd_api_requests_rate_refused") - refused == len(too_many)
    # another tenant and the admin, meanwhile: every answer 200, and faster than rate-b's bucket would let them go
    for codes_of, took_of in (other, mine):
        assert codes_of == [200] * others
        assert took_of < (others - burst) / rps, took_of
    assert DEFAULT_BURST >= others  # rate-c's default burst covers its requests: none of them waited


def _head_only(kube, token: str, path: str) -> bytes:
    """A POST that declares a 1 MB body and never sends it: the whole answer, read before any body byte is sent."""
    url = urlsplit(kube.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as raw, \
            kube.verify.wrap_socket(raw, server_hostname=url.hostname) as tls:
        tls.sendall(f"POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nAuthorization: Bearer {token}\r\n"
                    "Content-Type: application/yaml\r\nContent-Length: 1000000\r\n\r\n".encode())
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
            chunk = tls.recv(65536)
            if not chunk:
                break
            answer += chunk
        return answer


def _length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def test_past_the_queue_a_request_is_refused_before_its_body_is_read_on_any_path(kube, admin):
    put_policy(admin, "rate-e", quotas={"requestBurst": 1, "requestsPerSecond": 0.1})  # a turn every 10 s
    with tenant(kube, "rate-e") as e:
        token = e.headers["authorization"].removeprefix("Bearer ")
    delayed = _counter(admin, "rolloutd_api_requests_delayed")

    async def main():
        flood = asyncio.ensure_future(_flood(kube, token, jobs_path("rate-e"), 1 + MAX_WAITING))
        # the queue is full once MAX_WAITING of them wait (the first took the one token): the next waits 80 s
        await asyncio.to_thread(wait_until, lambda: _counter(admin, "rolloutd_api_requests_delayed") - delayed
                                >= MAX_WAITING, 60, "the token's queue to fill", 0.05)
        head = await asyncio.to_thread(_head_only, kube, token, jobs_path("rate-e"))
        with kube.client(token) as again:  # the node protocol's 403 to a namespace token spends its rate too
            node = await asyncio.to_thread(again.post, f"{jobs_path('rate-e')}/j/nodes/register", json={})
        flood.cancel()  # the waiting ones go on sleeping on the controller, bounded: they are its queue
        await asyncio.gather(flood, return_exceptions=True)
        return head, node

    head, node = asyncio.run(main())
    head = head.decode("latin-1")
    assert node.status_code == 429 and node.headers["retry-after"], node.text
    assert head.startswith("HTTP/1.1 429"), head
    assert "retry-after: " in head.lower() and "requestsPerSecond" in head, head


def test_a_bad_rate_is_refused_naming_the_field(admin):
    for field, value in (("requestsPerSecond", 0), ("requestsPerSecond", 10_001), ("requestBurst", 0)):
        doc = {"apiVersion": "rolloutd.io/v1alpha1", "kind": "TenantPolicy", "metadata": {"name": "rate-d"},
               "spec": {"quotas": {field: value}}}
        r = admin.put(f"{POLICIES}/rate-d", json=doc)
        assert r.status_code == 422, r.text
        assert [c["field"] for c in r.json()["details"]["causes"]] == [f"spec.quotas.{field}"], r.text
    assert DEFAULT_RPS == 50 and DEFAULT_BURST == 100  # the documented defaults (docs/content/multi-tenancy.md)
