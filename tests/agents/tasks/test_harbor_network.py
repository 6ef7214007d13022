"""The verifier's network (sandbox/host/egress.py, `sandbox.verifierNetwork`): on the real bwrap runtime, a Harbor
verifier reaches an HTTP server on the host's 127.0.0.1 (allowed by the admin, as a site mirror would be) only
with the job's consent and the task's `allow_internet`, and never without the admin's allowance; the agent's phase never reaches it, and what the agent left running is gone before the
verifier gets its proxy. (The real download of Terminal-Bench 2's verifiers, uv from astral.sh, cannot be
exercised here: only package registries are reachable.)"""
import asyncio
import http.server
import os
import shutil
import threading

import pytest

from rolloutd.agents.tasks import HandlerScope, get_handler
from rolloutd.crds.trajectory import Trajectory
from rolloutd.crds.kit.settings import SandboxSettings

from support.harbor_rollouts import task_sandbox

FETCH = """python3 - <<'PY'
import urllib.request
try:
    ok = urllib.request.urlopen("http://127.0.0.1:{port}/token", timeout=10).read() == b"secret-{port}"
except Exception:
    ok = False
print("reached" if ok else "unreachable")
{write}
PY
"""


@pytest.fixture(scope="module")
def host_server():
    """An HTTP server on the host's loopback, answering a token."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = f"secret-{self.server.server_port}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_port
    server.shutdown()
    server.server_close()


def _task(root, name: str, port: int, toml: str = "") -> None:
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "instruction.md").write_text("Nothing to do.\n")
    (task / "task.toml").write_text(toml)
    (task / "environment" / "Dockerfile").write_text("FROM debian:bookworm\nWORKDIR /app\n")
    write = 'open("/logs/verifier/reward.txt", "w").write("1" if ok else "0")'
    (task / "tests" / "test.sh").write_text("#!/bin/bash\n" + FETCH.format(port=port, write=write))


def test_the_verifier_reaches_the_host_only_with_consent_and_the_agent_never(host_server, tmp_path, monkeypatch):
    """The proxy refuses loopback (sandbox/host/egress.py): the host's server here stands for a site mirror the admin
    allows (ROLLOUTD_EGRESS_ALLOW); without that the consented verifier is refused too."""
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("bwrap and mmdebstrap are needed (bash .ci/system-packages.sh)")
    if os.geteuid() != 0:
        pytest.skip("building the test image needs root")
    _task(tmp_path / "tasks", "online", host_server)
    _task(tmp_path / "tasks", "offline", host_server, "[environment]\nallow_internet = false\n")
    handler = get_handler("harbor")
    tasks = {t["id"]: t for t in handler.load(tmp_path / "tasks")}
    agent_probe = FETCH.format(port=host_server, write="")
    proxied_probe = "".join(f"export {k}=http://127.0.0.1:41401; " for k in ("http_proxy", "HTTP_PROXY")) + agent_probe

    async def one(task_id: str, consent: bool, allow: bool = True):
        # the node's settings, as its daemon hands them to the handler
        handler.bind(HandlerScope(sandbox_settings=SandboxSettings.from_env(
            {"ROLLOUTD_EGRESS_ALLOW": "127.0.0.1/32"} if allow else {})))
        task = dict(tasks[task_id])
        async with task_sandbox(handler, task, verifier_network=consent) as sandbox:
            seen = [(await sandbox.bash(probe)).output.split()[-1] for probe in (agent_probe, proxied_probe)]
            leftover = (await sandbox.bash("sleep 1000 > /dev/null 2>&1 & echo $!")).output.split()[-1]
            reward = await handler.eval(task, sandbox, Trajectory(job="j", prompt=0, sample=0))
            # a zombie runs nothing (init reaps it within a moment): only another state is alive
            alive = (await sandbox.bash(f"read -r s < /proc/{leftover}/stat 2>/dev/null && s=${{s##*) }} && "
                                        f"[ ${{s%% *}} != Z ] && echo alive || echo gone",
                                        session="after")).output.split()[-1]
            return seen, reward, alive

    async def main():
        out = {(t, c): await one(t, c) for t, c in (("online", True), ("online", False), ("offline", True))}
        out["not allowed"] = await one("online", True, allow=False)
        return out

    out = asyncio.run(main())
    for seen, _, _ in out.values():  # the agent's phase: neither directly nor through a proxy port
        assert seen == ["unreachable", "unreachable"]
    seen, reward, alive = out[("online", True)]
    assert reward.value == 1.0 and reward.details["verifier_network"] is True
    assert alive == "gone"  # what the agent left running never shares the verifier's way out
    for key in (("online", False), ("offline", True)):
        assert out[key][1].value == 0.0 and out[key][1].details["verifier_network"] is False
    reward = out["not allowed"][1]  # consent, but the host's loopback is not the internet
    assert reward.value == 0.0 and reward.details["verifier_network"] is True
