"""The container image (charts/image/Containerfile), built with Debian's podman from an mmdebstrap base and run:
the controller starts from it as the unprivileged user 1000 and answers, and a node daemon inside it (the
local executor's) runs a real job's rollouts in bwrap sandboxes inside the container; both under the Helm
chart's settings (read-only root, every capability dropped, no privilege escalation).

The build is cached in podman's store by content (charts/image/build.py): a second run only tags it. The LLM
is a stand-in on the host's loopback (tests/support/stub_llm.py; the container shares the host's network) scripted to
make one bash tool call, whose output, read back from the trajectories, shows a sandbox that hides the
container's own /data. `SANDBOX_OPTIONS` are the fewest podman options bwrap needs in the container; each is
shown necessary below. Needs root (podman runs rootful here) and `make system-packages` (podman, mmdebstrap).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from support.ports import free_port
from support.stub_llm import StubLLM, _StubBackend
from support.waiting import wait_until

from rolloutd.agents.engine.model_dirs import model_dir

REPO = Path(__file__).resolve().parents[2]
JOBS = "/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs"
# What bwrap (run by the non-root daemon, so through user namespaces) needs from podman: podman's masked /proc
# paths make the kernel refuse the sandbox a fresh /proc. Its default seccomp profile allows user namespaces, and
# no capability is added.
SANDBOX_OPTIONS = ("--security-opt", "unmask=/proc/*")
# How the Helm chart runs it (charts/rolloutd: readOnlyRootFilesystem, capabilities dropped, no privilege
# escalation, HOME and /tmp on an emptyDir)
AS_THE_CHART = ("--read-only", "--tmpfs", "/tmp", "-e", "HOME=/tmp", "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges")
PROBE = "echo MARK-$((6*7)); ls -d /data /opt/rolloutd 2>&1"  # the container has both; a sandbox only the venv
TIMINGS: dict[str, float] = {}

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("podman") or not shutil.which("mmdebstrap"),
                                reason="needs root, podman and mmdebstrap (make system-packages)")


def _image_build():
    """charts/image/build.py (`make image`): the build, and the podman options this host needs."""
    spec = importlib.util.spec_from_file_location("image_build", REPO / "charts" / "image" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


IMAGE_BUILD = _image_build()


@pytest.fixture(scope="module")
def image() -> str:
    t0 = time.monotonic()
    ref = IMAGE_BUILD.build()
    TIMINGS["build"] = time.monotonic() - t0
    print(f"\nimage {ref}: built or found in {TIMINGS['build']:.1f} s")
    return ref


def _podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    if args[0] == "run":
        args = ("run", *IMAGE_BUILD.limit_options(), *args[1:])
    done = subprocess.run(["podman", *IMAGE_BUILD.host_options(), *args], capture_output=True, text=True, timeout=timeout)
    assert not check or done.returncode == 0, f"podman {' '.join(args)}: {done.stderr[-2000:]}"
    return done


class Controller:
    """`rolloutd controller` in a container of the image, on the host's network, its data dir a volume."""

    def __init__(self, base: Path, name: str, port: int) -> None:
        self.data, self.name, self.port = base / "data", name, port
        self.url = f"http://127.0.0.1:{port}"

    @property
    def token(self) -> str:
        return (self.data / "rolloutd" / "token").read_text().strip()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=30)

    def logs(self) -> str:
        out = _podman("logs", self.name, check=False)
        daemons = "".join(p.read_text(errors="replace")[-3000:] for p in (self.data / "rolloutd" / "logs").glob("*.log"))
        return (out.stdout + out.stderr)[-3000:] + daemons


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def controller(image: str, base: Path, *options: str, executors: str = "", mounts: dict[str, Path] | None = None,
               env: dict[str, str] | None = None):
    """The container started (`options` added to podman run, `mounts` read-only at their keys), healthy; removed after."""
    mounts, env = mounts or {}, env or {}
    port, name = free_port(), f"rolloutd-test-{os.getpid()}-{free_port()}"
    c = Controller(base, name, port)
    c.data.mkdir()
    os.chown(c.data, 1000, 1000)  # the image's user writes it (rootful podman: the same uid on the host)
    volumes = [f"{c.data}:/data"] + [f"{src}:{dest}:ro" for dest, src in mounts.items()]
    # no --rm: a crashed controller's log outlives it, for the assertion; removed below
    _podman("run", "-d", "--name", name, "--network", "host", *options,
            *[a for v in volumes for a in ("-v", v)], *[a for k, v in env.items() for a in ("-e", f"{k}={v}")],
            image, "rolloutd", "controller", "--data-dir", "/data/rolloutd", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", "--executors", executors)
    try:
        t0 = time.monotonic()
        wait_until(lambda: _healthy(c.url) or _podman("container", "exists", name, check=False).returncode,
                   timeout=90, what="the controller in the container to answer /healthz")
        assert _healthy(c.url), f"the container exited: {c.logs()}"
        TIMINGS["controller start"] = time.monotonic() - t0
        yield c
    finally:
        _podman("rm", "-f", "-t", "5", name, check=False)


def test_the_controller_starts_from_the_image_as_a_non_root_user(image, tmp_path):
    with controller(image, tmp_path, *AS_THE_CHART) as c:
        with c.client() as api:
            r = api.get(JOBS)
            assert r.status_code == 200 and r.json()["kind"] == "RolloutJobList", r.text
        assert httpx.get(f"{c.url}{JOBS}").status_code == 401  # no token, no answer
        assert (c.data / "rolloutd" / "token").stat().st_uid == 1000  # written by the image's user
        assert _podman("exec", c.name, "id", "-u").stdout.strip() == "1000"
        assert _podman("exec", c.name, "bwrap", "--version").returncode == 0
    assert _podman("image", "inspect", "--format", "{{.Config.User}}", image).stdout.strip() == "1000:1000"


class _ScriptedBackend(_StubBackend):
    """One bash tool call (PROBE) on the first turn, then the end of the turn."""
    tokenizer = None

    def do_POST(self) -> None:  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        tok = self.tokenizer
        first = "MARK-" not in tok.decode(req.get("prompt") or [])
        ids = tok.encode(f'<tool_call>{json.dumps({"name": "bash", "arguments": {"command": PROBE}})}</tool_call>',
                         add_special_tokens=False) if first else [tok.eos_token_id]
        self._send({"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)},
                                 "finish_reason": "stop", "prompt_token_ids": req.get("prompt")}]})


@pytest.fixture(scope="module")
def scripted_llm():
    from transformers import AutoTokenizer

    _ScriptedBackend.tokenizer = AutoTokenizer.from_pretrained(str(model_dir("tiny")))
    stub = StubLLM()
    stub.server.RequestHandlerClass = _ScriptedBackend
    yield stub
    stub.close()


def _job(backend: str) -> dict:
    return {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": "in-image"},
            "spec": {"tasks": {"kind": "math", "source": "/tasks/train.jsonl", "limit": 2}, "samplesPerPrompt": 2,
                     "agent": {"maxTurns": 2, "tools": ["bash", "submit"],
                               "sampling": {"maxTokensPerTurn": 256, "maxTotalTokens": 3000}},
                     "llm": {"tokenizer": "/models/tiny", "backends": [{"url": backend}]},
                     "sandbox": {"runtime": "bwrap", "image": "host", "network": False},
                     "executor": {"kind": "local", "nodes": 1},
                     "pipeline": {"workersPerNode": {"init": 2, "run": 2, "eval": 2}}}}


def _tasks(tmp_path: Path) -> Path:
    tasks = tmp_path / "tasks"
    tasks.mkdir(mode=0o755)
    tasks.chmod(0o755)
    (tasks / "train.jsonl").write_text("".join(json.dumps({"id": f"q{i}", "question": f"What is {i} + 1?",
                                                           "answer": str(i + 1)}) + "\n" for i in range(2)))
    (tasks / "train.jsonl").chmod(0o644)
    return tasks


def _observations(trajectory: dict, tok) -> list[str]:
    """The decoded observation of each turn (what the tool calls returned)."""
    ids = trajectory["tokenIds"]
    return [tok.decode(ids[t["observationStart"]:t["observationEnd"]]) for t in trajectory["turns"]
            if t.get("observationStart") is not None]


def test_a_node_daemon_in_the_image_runs_a_jobs_rollouts_in_bwrap(image, tmp_path, scripted_llm):
    mounts = {"/tasks": _tasks(tmp_path), "/models/tiny": model_dir("tiny")}
    t0 = time.monotonic()
    with controller(image, tmp_path, *AS_THE_CHART, *SANDBOX_OPTIONS, executors="local", mounts=mounts,
                    env={"ROLLOUTD_TOKENIZER_ROOTS": "/models"}) as c, c.client() as api:
        r = api.post(JOBS, json=_job(scripted_llm.url))
        assert r.status_code == 201, r.text
        phase = wait_until(lambda: (p := api.get(f"{JOBS}/in-image").json()["status"].get("phase")) in (
            "Succeeded", "Failed") and p, timeout=240, every=0.5, what="the job to end")
        status = api.get(f"{JOBS}/in-image").json()["status"]
        assert phase == "Succeeded", (status, c.logs())
        lines = [json.loads(x) for x in api.get(f"{JOBS}/in-image/trajectories").text.splitlines() if x.strip()]
    TIMINGS["job in the image"] = time.monotonic() - t0
    print(f"timings: {TIMINGS}")
    assert len(lines) == 4, lines
    for t in lines:
        assert t["failure"]["kind"] != "infra", t["failure"]
        seen = _observations(t, scripted_llm.server.RequestHandlerClass.tokenizer)
        assert seen and "MARK-42" in seen[0], seen  # the command ran, in the sandbox
        # the container has /data (the controller's); bwrap's sandbox shows the venv and not /data
        assert "/opt/rolloutd" in seen[0] and "cannot access '/data'" in seen[0], seen


@pytest.mark.parametrize("dropped", range(0, len(SANDBOX_OPTIONS), 2))
def test_bwrap_in_the_container_needs_each_of_the_sandbox_options(image, dropped):
    """SANDBOX_OPTIONS are needed: bwrap as the image's user works with all of them, fails with one left out
    (what the `podman run` in the docs says)."""
    argv = ("bwrap", "--unshare-all", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "true")
    assert _podman("run", "--rm", "--network", "none", *SANDBOX_OPTIONS, image, *argv, check=False).returncode == 0
    fewer = SANDBOX_OPTIONS[:dropped] + SANDBOX_OPTIONS[dropped + 2:]
    without = _podman("run", "--rm", "--network", "none", *fewer, image, *argv, check=False)
    assert without.returncode != 0, f"bwrap ran without {SANDBOX_OPTIONS[dropped + 1]}"
