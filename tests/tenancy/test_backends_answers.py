"""A backend's answers never reach the tenant: team-a points its job at loopback services (an SSRF read and a
port scan from the controller and the node) that answer a secret with 500, with bad JSON, or with a malformed
status line. Health reasons, reload errors, metrics, the controller's log and the node's LLM errors carry a
status and a fixed reason, never a byte of the body."""
from __future__ import annotations

import asyncio
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support.kube_helpers import tenant_job_doc, tenant_policy
from support import controller_process as _fixtures
from support.waiting import wait_until

from rolloutd.agents.llm import BackendError, SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend
from rolloutd.controller.access.auth import create_scoped_token

TESTS = Path(__file__).resolve().parents[1]
EXAMPLE = TESTS.parent / "examples" / "math-demo.yaml"
P = "/apis/rolloutd.io/v1alpha1"
SECRET = "s3cr3t-0f-the-loopback-service"


class _Secret500(BaseHTTPRequestHandler):
    """Every call: 500 with the secret as its body."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        body = f'{{"detail": "{SECRET}"}} {SECRET}'.encode()
        self.send_response(500)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


class _SecretJunk(_Secret500):
    """/health answers 200; everything else 200 with a body that is not what the caller expects."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        if self.path.startswith("/health"):
            body = b""
        elif self.path.startswith("/v1/completions"):
            body = f'{{"choices": [{{"text": "{SECRET}"}}], "x": "{SECRET}"}}'.encode()
        else:
            body = f"{{{SECRET}".encode()  # not JSON
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer


def _serve(handler) -> tuple[str, ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def _bad_status_line() -> tuple[str, socket.socket]:
    """A raw service whose status line is the secret (an HTTP client's error quotes the line it could not parse)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)

    def run() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(f"HTTP/1.1 {SECRET}\r\n{SECRET}\r\n\r\n".encode())

    threading.Thread(target=run, daemon=True).start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}", sock


@pytest.fixture
def services():
    (a, sa), (b, sb), (c, sc) = _serve(_Secret500), _serve(_SecretJunk), _bad_status_line()
    yield a, b, c
    sa.shutdown(), sb.shutdown(), sc.close()


@pytest.fixture
def controller(tmp_path):
    c = _fixtures.ControllerProcess(tmp_path / "data").start()
    yield c
    c.stop()


def _job(backend: str) -> dict:
    doc = tenant_job_doc("probe")  # its dataset beneath the tenant data root the policy grants
    doc["metadata"] = {"name": "probe"}
    doc["spec"]["llm"]["backends"] = [{"url": backend}]
    doc["spec"]["executor"]["nodes"] = 1
    return doc


def test_health_reasons_reload_errors_metrics_and_logs_carry_no_byte_of_a_backends_body(controller, services):
    secret500, junk, bad_line = services
    team = create_scoped_token(controller.data_dir / "tokens", "team-a", read_only=False, namespaces=["team-a"])
    job = f"{P}/namespaces/team-a/rolloutjobs/probe"
    with controller.client(controller.token) as admin:  # the admin's job in team-a, whose policy admits its spec
        # (a tenant's backend write is admitted against the tenant's policy, whoever wrote the job)
        assert admin.put(f"{P}/tenantpolicies/team-a", json=tenant_policy(
            "team-a", ownedBackends=[secret500, junk, bad_line])).status_code in (200, 201)
        assert admin.post(f"{P}/namespaces/team-a/rolloutjobs", json=_job(secret500)).status_code == 201
    with controller.client(team.token) as a:  # the tenant adds backends, reads the job, its events and metrics
        for url in (secret500, junk, bad_line):  # the pool probes what a job lists once it is added
            added = a.post(f"{job}/backends", json={"url": url})
            assert added.status_code == 200, added.text
        seen: dict[str, dict] = {}

        def probed() -> bool:  # every backend probed: the two failing ones carry a reason
            seen.update({b["url"]: b for b in a.get(f"{job}/backends").json()["items"]})
            return all(seen.get(u, {}).get("reason") for u in (secret500, bad_line))

        wait_until(probed, timeout=30, what="the health probe of the loopback services")
        assert seen[secret500]["reason"] == "HTTP 500" and not seen[secret500]["healthy"]
        assert seen[bad_line]["reason"].startswith("/health: request failed")
        policy = a.post(f"{job}/policy", json={"version": 2, "weightsPath": "/tmp/w", "pause": False})
        assert policy.status_code == 200, policy.text
        errors = {b["url"]: b["error"] for b in policy.json()["backends"]}
        assert errors[secret500] == "reload_weights: HTTP 500"
        assert errors[bad_line].startswith("pause: request failed") or errors[bad_line].startswith("reload_weights")
        status = a.get(job).json()
        metrics = a.get("/metrics").text if a.get("/metrics").status_code == 200 else ""
        events = a.get(f"{job}/events").text
        answers = [a.get(f"{job}/backends").text, policy.text, str(status), metrics, events]
    log = (controller.data_dir.parent / f"controller-{controller.port}.log").read_text(errors="replace")
    for text in [*answers, log]:
        assert SECRET not in text and SECRET[:8] not in text


def test_the_nodes_llm_errors_carry_a_status_never_the_body(services):
    secret500, junk, bad_line = services

    async def errors() -> list[str]:
        out = []
        for url, model in ((secret500, None), (junk, None), (junk, "m"), (bad_line, None)):
            async with VLLMBackend(url, model, timeout=5, connect_timeout=5) as llm:
                try:
                    if model is not None:  # past discovery: the completion's answer itself is junk
                        llm._discovered = True
                    await llm.generate([1, 2, 3], SamplingParams(max_tokens=4), "r1")
                except BackendError as e:
                    out.append(str(e))
        return out

    messages = asyncio.run(errors())
    assert len(messages) == 4, messages
    assert "HTTP 500" in messages[0]
    for m in messages:
        assert SECRET[:8] not in m, m
