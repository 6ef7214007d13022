"""EVAL's staging is out of the agent's reach (issue 24, item 8), through the harbor handler as
tests/agents/tasks/test_harbor.py drives it: real image, real bwrap, real server, the oracle agent as the attacker.

A process the agent leaves running swaps every staging directory it sees in the workspace for a forged
`tests/` (one atomic `renameat2(RENAME_EXCHANGE)`) whose test.sh writes reward 1. On the code before, the
verifier's tests were staged through the workspace and the forgery scored 1.0 with `agent_confined: true`.
Next step: the rest of the tenancy suite (tests/tenancy/).
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rolloutd.agents.tasks import EvalError, get_handler

from support.harbor_rollouts import task_sandbox
from support.waiting import wait_until

TASKS = Path(__file__).resolve().parents[2] / "examples" / "harbor" / "tasks"
RUNS = 8

SWAPPER = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
FORGED = "#!/bin/bash\necho FORGED; mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt\n"
def forged(n):
    d = "/workspace/.forged-%d" % n
    os.makedirs(d, exist_ok=True)
    for name, text in (("test.sh", FORGED), ("test_outputs.py", "def test_ok():\n    pass\n")):
        with open(d + "/" + name, "w") as f:
            f.write(text)
    return d
n, seen = 0, set()
spare = forged(n)
while True:
    try:
        names = os.listdir("/workspace")
    except OSError:
        continue
    for name in names:
        if name.startswith(".rolloutd-stage-") and name not in seen:
            if libc.renameat2(-100, spare.encode(), -100, ("/workspace/" + name).encode(), 2) == 0:
                seen.add(name)
                n += 1
                spare = forged(n)
"""
SOLVE = ("#!/bin/bash\necho '{\"orders\": 1, \"total\": 0}' > /app/total.json\n"
         "cat > /tmp/swapper.py <<'PY'\n" + SWAPPER + "PY\n"
         "nohup python3 /tmp/swapper.py > /dev/null 2>&1 &\nnohup python3 /tmp/swapper.py > /dev/null 2>&1 &\n"
         "sleep 0.3\n")


def _needs_image():
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("bwrap and mmdebstrap are needed (bash .ci/system-packages.sh)")
    if os.geteuid() != 0:
        pytest.skip("building the task's image needs root here")


def _swapping_task(tmp_path: Path) -> dict:
    task = tmp_path / "tasks" / "csv-total"
    shutil.copytree(TASKS / "csv-total", task)
    (task / "solution" / "solve.sh").write_text(SOLVE)
    return get_handler("harbor").load(tmp_path / "tasks")[0]


async def _rollout(handler, task: dict):
    from rolloutd.agents.loop.rollout import AgentConfig, RolloutContext

    async with task_sandbox(handler, task) as sandbox:
        trajectory = await handler.run(task, sandbox, None, tokenizer=None, config=AgentConfig(agent_kind="oracle"),
                                       ctx=RolloutContext(job="j", prompt=0, sample=0, task_id=task["id"]))
        try:
            reward = await handler.eval(task, sandbox, trajectory)
        except EvalError as e:  # a swap half-way through the copy: infra, never scored (an attack that missed)
            return trajectory, None, str(e)
        assert reward.details["agent_confined"] is True
        return trajectory, reward.value, reward.details["verifier_output"]


def test_a_process_the_agent_left_never_swaps_the_verifiers_tests(tmp_path):
    _needs_image()
    handler = get_handler("harbor")
    task = _swapping_task(tmp_path)

    async def main():
        return [await _rollout(handler, task) for _ in range(RUNS)]

    results = asyncio.run(main())
    if not results[0][0].metrics["agent_confined"]:
        pytest.skip("this kernel has no Landlock: the agent runs unconfined (README: Known gap)")
    forged = [(value, output[-200:]) for _, value, output in results if "FORGED" in output or value != 0.0]
    assert forged == [], f"{len(forged)} of {RUNS} rollouts ran or scored the forged verifier"
    assert all(" failed" in output for _, _, output in results)  # the task's own tests ran, and failed


def test_two_network_rollouts_relays_each_reach_their_own_gateway(tmp_path):
    """`network: true` was the host's namespace: two harness rollouts' relays (agents/gateway/server.py, one port for
    every rollout) met on the host's loopback, the second could not listen. Each has its own loopback now."""
    _needs_image()
    if shutil.which("slirp4netns") is None:
        pytest.skip("slirp4netns is not installed (.ci/system-packages.sh)")
    from rolloutd.agents.loop.rollout import AgentConfig, RolloutContext

    from support.harbor_rollouts import PROBE

    handler = get_handler("harbor")
    task = [t for t in handler.load(TASKS) if t["id"] == "csv-total"][0]

    async def one(sandbox, sample: int) -> str:
        await handler.run(task, sandbox, None, tokenizer=None,
                          config=AgentConfig(agent_kind="harness", agent_command=PROBE),
                          ctx=RolloutContext(job="j", prompt=0, sample=sample, task_id=task["id"]))
        return (await sandbox.read_file("/logs/agent/harness.txt")).strip()

    async def main():  # both open at once: the first one's relay still listens while the second starts its own
        async with task_sandbox(handler, task, network=True) as a, task_sandbox(handler, task, network=True) as b:
            first = await one(a, 0)
            try:
                second = await one(b, 1)
            except RuntimeError as e:  # the relay could not listen: its port was taken on a shared loopback
                second = str(e)
            return [first, second]

    assert asyncio.run(main()) == ["policy", "policy"]


# -- a root filesystem image the tenant's Dockerfile built -------------------------------------------------------
def _image_copy(tmp_path: Path) -> Path:
    """The task's image, as hard links (the cache is untouched)."""
    rootfs = asyncio.run(get_handler("harbor").image(get_handler("harbor").load(TASKS)[0])).rootfs
    image = tmp_path / "image"
    subprocess.run(["cp", "-al", str(rootfs), str(image)], check=True)
    return image


def _shared_objects(root: Path) -> set[tuple[int, int]]:
    out = set()
    for top in ("usr/lib", "usr/local/lib"):
        for dirpath, _, names in os.walk(root / top):
            for name in names:
                if ".so" in name and not os.path.islink(os.path.join(dirpath, name)):
                    st = os.stat(os.path.join(dirpath, name))
                    out.add((st.st_dev, st.st_ino))
    return out


def test_an_image_never_steers_the_server_while_it_is_root(tmp_path):
    """The server runs as root until it drops privileges. On the code before it ran under the image's loader,
    /etc/ld.so.cache and libraries (a tenant's Dockerfile builds them: its libc would run as root). Now not one
    shared object the server maps is the image's; the agent's own processes still run on the image's."""
    _needs_image()
    from rolloutd.sandbox import SandboxSpec, get_runtime
    from rolloutd.sandbox.host.footprint import pids_with_id

    image = _image_copy(tmp_path)
    theirs = _shared_objects(image)

    def mapped(pid: int) -> set[tuple[int, int]]:
        out = set()
        for line in open(f"/proc/{pid}/maps"):
            fields = line.split()
            if len(fields) >= 6 and ".so" in fields[5]:
                st = os.stat(f"/proc/{pid}/map_files/{fields[0]}")
                out.add((st.st_dev, st.st_ino))
        return out

    async def main():
        sandbox = await get_runtime("bwrap").create(SandboxSpec(image=str(image)))
        try:
            await sandbox.bash("sleep 30 > /dev/null 2>&1 &")

            def command_lines() -> dict[int, bytes]:
                return {p: open(f"/proc/{p}/cmdline", "rb").read() for p in pids_with_id(sandbox.id)}

            await asyncio.to_thread(wait_until, lambda: any(c.startswith(b"sleep") for c in command_lines().values()))
            lines = command_lines()
            server = [p for p, c in lines.items() if b"-S\0-c\0" in c]
            sleeper = [p for p, c in lines.items() if c.startswith(b"sleep")]
            return mapped(server[0]), mapped(sleeper[0])
        finally:
            await sandbox.close()

    by_server, by_agent = asyncio.run(main())
    assert by_agent & theirs  # the agent's `sleep` runs on the image's libc
    assert not by_server & theirs, "the server, still root, loaded the image's shared objects"


def test_an_image_with_a_preload_file_is_refused(tmp_path):
    """/etc/ld.so.preload would be read by the loader of every process, the server's included."""
    _needs_image()
    from rolloutd.sandbox import SandboxSpec, get_runtime
    from rolloutd.sandbox.errors import SandboxCreateError

    image = _image_copy(tmp_path)
    (image / "etc" / "ld.so.preload").write_text("/usr/lib/x86_64-linux-gnu/libffi.so.8\n")
    with pytest.raises(SandboxCreateError, match=r"spec\.sandbox\.image .*ld\.so\.preload"):
        asyncio.run(get_runtime("bwrap").create(SandboxSpec(image=str(image))))
