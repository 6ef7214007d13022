"""harbor handler: Harbor task directories in the public layout (examples/harbor/tasks: python:3.12-slim,
ubuntu:24.04 and debian:bookworm Dockerfiles with apt-get/pip installs, COPY, WORKDIR, ENV, ARG, USER;
pytest verifiers) built into bwrap images; the oracle scores 1 and a no-op agent 0, as root and as an
unprivileged user; a verifier without a reward is infra, never 0.

The first run builds the bookworm base and three images (~2-3 min, cached under ~/.cache/rolloutd/images
by content); later runs reuse them."""
import asyncio
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rolloutd.agents.tasks import DatasetError, EvalError, get_handler
from rolloutd.agents.tasks.base import ConfigError, HandlerScope
from rolloutd.crds.tenancy import TenantQuotas
from rolloutd.agents.tasks.harbor import parse_reward, stage_dir
from rolloutd.crds.trajectory import Trajectory
from rolloutd.sandbox import SandboxSpec
from rolloutd.sandbox.image.build import find_dockerfile, image_key
from rolloutd.crds.kit.settings import SandboxSettings
from rolloutd.sandbox.image.rootfs import image_cache_dir

from support import harbor_rollouts  # also run as a script, as another user
from support.harbor_rollouts import harness_probe, rollouts, task_sandbox

ROOT = Path(__file__).resolve().parents[3]
TASKS = ROOT / "examples" / "harbor" / "tasks"
EXPECTED = {"config-port": {"oracle": 1.0, "noop": 0.0}, "csv-total": {"oracle": 1.0, "noop": 0.0},
            "word-count": {"oracle": 1.0, "noop": 0.0}}


def _needs_builders():
    if shutil.which("bwrap") is None or shutil.which("mmdebstrap") is None:
        pytest.skip("bwrap and mmdebstrap are needed (bash .ci/system-packages.sh)")
    if os.geteuid() != 0 and not all((image_cache_dir(SandboxSettings.from_env().images) / _key(d)).is_dir() for d in TASKS.iterdir()):
        pytest.skip("building a base root filesystem needs root (or prebuilt images in $ROLLOUTD_IMAGE_DIR)")


def _key(task_dir: Path) -> str:
    context, dockerfile = find_dockerfile(task_dir)
    return image_key(context, dockerfile, {})


@pytest.fixture(scope="module")
def built():
    _needs_builders()
    return asyncio.run(rollouts(str(TASKS)))


def test_oracle_scores_1_and_noop_scores_0_in_each_tasks_own_image(built):
    assert built == EXPECTED


def test_image_is_the_dockerfiles(built):
    """The build did what each Dockerfile says: ENV, WORKDIR (writable), USER, COPY --chown, bookworm."""
    handler = get_handler("harbor")
    task = {t["id"]: t for t in handler.load(TASKS)}["config-port"]

    async def main():
        async with task_sandbox(handler, task) as sandbox:
            output = (await sandbox.bash("cd /opt/webapp-work && pwd && echo $APP_HOME && touch written && "
                                         "grep -c bookworm /etc/os-release && python3 -c 'import pytest' && "
                                         "echo ok")).output
            return output, await handler.image(task)

    output, image = asyncio.run(main())
    assert output.split() == ["/opt/webapp-work", "/opt/webapp-work", "3", "ok"]
    webapp = next(line.split(":") for line in (image.rootfs / "etc/passwd").read_text().splitlines()
                  if line.startswith("webapp:"))
    # made by `RUN touch` after `USER webapp`, and by `COPY --chown=webapp` (uids of the image, not the host)
    assert (image.rootfs / "home/webapp/made-as-user").stat().st_uid == int(webapp[2])
    assert (image.rootfs / "etc/webapp/app.ini").stat().st_uid == int(webapp[2])
    assert image.base == "debian:bookworm" and image.env["APP_HOME"] == "/opt/webapp-work"


def _copy_task(tmp_path: Path, test_sh: str) -> Path:
    task = tmp_path / "tasks" / "csv-total"
    shutil.copytree(TASKS / "csv-total", task)
    (task / "tests" / "test.sh").write_text(test_sh)
    return tmp_path / "tasks"


@pytest.mark.parametrize("test_sh, why", [
    ("#!/bin/bash\npython -m pytest /tests/test_outputs.py\n", "wrote no reward"),
    ("#!/bin/bash\nkill -SEGV $$\n", "wrote no reward"),
    ("#!/bin/bash\necho maybe > /logs/verifier/reward.txt\n", "wrote no reward"),
])
def test_a_verifier_without_a_reward_is_infra_not_0(built, tmp_path, test_sh, why):
    handler = get_handler("harbor")
    task = handler.load(_copy_task(tmp_path, test_sh))[0]

    async def main():
        async with task_sandbox(handler, task) as sandbox:
            await sandbox.bash("echo '{\"orders\": 4, \"total\": 50.74}' > /app/total.json")  # a right answer
            return await handler.eval(task, sandbox, Trajectory(job="j", prompt=0, sample=0))

    with pytest.raises(EvalError, match=why):
        asyncio.run(main())


def test_the_agent_cannot_plant_the_reward_or_the_tests(built):
    handler = get_handler("harbor")
    task = {t["id"]: t for t in handler.load(TASKS)}["csv-total"]

    async def main():
        async with task_sandbox(handler, task) as sandbox:
            await sandbox.bash("echo 1 > /logs/verifier/reward.txt; mkdir -p /tests; "
                               "printf 'def test_ok():\\n    pass\\n' > /tests/test_outputs.py")
            return await handler.eval(task, sandbox, Trajectory(job="j", prompt=0, sample=0))

    assert asyncio.run(main()).value == 0.0


def test_the_task_runs_contained_and_owns_what_is_staged(built, tmp_path):
    """The agent and verifier never run as root (uid 65534 under a root daemon), cannot write into the
    image, and own what the node stages (a 0700 host dir, 0600 file): readable, changeable, no leftover."""
    handler = get_handler("harbor")
    task = {t["id"]: t for t in handler.load(TASKS)}["csv-total"]
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "secret-ish.txt").write_text("staged\n")
    (private / "secret-ish.txt").chmod(0o600)

    async def main():
        async with task_sandbox(handler, task) as sandbox:
            await stage_dir(sandbox, private, "/tests")
            out = (await sandbox.bash("id -u; stat -c %u /tests/secret-ish.txt; cat /tests/secret-ish.txt; "
                                      "echo more >> /tests/secret-ish.txt && echo changed; "
                                      "touch /usr/local/planted 2>/dev/null || echo image-read-only; "
                                      "ls -A /workspace | grep -c rolloutd-stage")).output.split()
            return out, [p.name for p in Path(sandbox.workspace).iterdir()]

    out, host_listing = asyncio.run(main())
    uid = str(65534 if os.geteuid() == 0 else os.geteuid())
    assert out == [uid, uid, "staged", "changed", "image-read-only", "0"]
    assert not any(name.startswith(".rolloutd-stage") for name in host_listing)


def _unprivileged_user() -> str:
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("switching to an unprivileged user needs root and runuser")
    return "nobody"


def _link_interpreter(prefix: Path, dest: Path) -> None:
    """Hard links of the interpreter and its standard library (not its site-packages: ours come from
    the venv), so the copy is cheap."""
    stdlib = f"lib/python{sys.version_info.major}.{sys.version_info.minor}"
    (dest / stdlib).mkdir(parents=True)
    subprocess.run(["cp", "-al", str(prefix / "bin"), str(dest)], check=True)
    subprocess.run(["cp", "-al", *map(str, (prefix / "lib").glob("libpython*")), str(dest / "lib")], check=True)
    subprocess.run(["cp", "-al", *(str(p) for p in (prefix / stdlib).iterdir() if p.name != "site-packages"),
                    str(dest / stdlib)], check=True)


def _as_unprivileged_daemon(extra_env: dict[str, str], tasks: Path = TASKS):
    """Runs tests/support/harbor_rollouts.py as `nobody`: its own interpreter (a hard-linked copy of ours: /root
    is not readable) and the images in a directory it can read, as a cluster filesystem cache would be."""
    user = pwd.getpwnam(_unprivileged_user())
    shared = Path(tempfile.mkdtemp(prefix="rolloutd-harbor-user-", dir="/var/tmp"))
    try:
        os.chmod(shared, 0o755)
        python = shared / "python"
        _link_interpreter(Path(sys.base_prefix), python)
        images = shared / "images"
        images.mkdir()
        for task_dir in tasks.iterdir():
            subprocess.run(["cp", "-al", str(image_cache_dir(SandboxSettings.from_env().images) / _key(task_dir)), str(images)], check=True)
        os.chown(images, user.pw_uid, user.pw_gid)
        site_dir = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
        interpreter = python / Path(sys.executable).resolve().relative_to(Path(sys.base_prefix).resolve())
        # LD_LIBRARY_PATH: the copy's libpython (its RUNPATH names the original, under /root)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(shared), "ROLLOUTD_IMAGE_DIR": str(images),
               "LD_LIBRARY_PATH": str(python / "lib"),
               "ROLLOUTD_SANDBOX_DIR": str(shared / "sandboxes"), **extra_env}
        (shared / "sandboxes").mkdir(mode=0o700)
        os.chown(shared / "sandboxes", user.pw_uid, user.pw_gid)
        proc = subprocess.run([shutil.which("runuser"), "-u", user.pw_name, "--", str(interpreter),
                               harbor_rollouts.__file__, str(tasks), site_dir],
                              env=env, capture_output=True, text=True, timeout=600, cwd=shared)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_oracle_1_noop_0_as_an_unprivileged_user(built):
    assert _as_unprivileged_daemon({}) == EXPECTED


def test_a_harness_reaches_its_gateway_as_root_and_as_an_unprivileged_user(built):
    """The gateway's socket and relay serve the sandbox's user: uid 65534 under root, the daemon's otherwise."""
    assert asyncio.run(harness_probe(str(TASKS))) == {"config-port": "policy"}
    assert _as_unprivileged_daemon({"ROLLOUTD_TEST_HARNESS_PROBE": "1"}) == {"config-port": "policy"}


WHO = "id -u; id -g; echo $HOME; cat $HOME/marker; touch $HOME/new && echo home-writable; touch x && stat -c %u x"


@pytest.fixture(scope="module")
def user_tasks():
    """Tasks whose agent runs as the image's user: the Dockerfile's last USER (`last-user`), task.toml's
    `[agent] user` over a `USER root` (`toml-user`); `root-user` ends as root (today's unprivileged user).
    Under /var/tmp, readable by the unprivileged daemon of the test below."""
    _needs_builders()
    if os.geteuid() != 0:
        pytest.skip("building the test images needs root")
    top = Path(tempfile.mkdtemp(prefix="rolloutd-harbor-users-", dir="/var/tmp"))
    os.chmod(top, 0o755)
    base = ("FROM debian:bookworm\nRUN useradd --create-home --uid 1234 agent && echo hi > /home/agent/marker\n"
            "USER {}\nWORKDIR /app\n")
    for name, user, toml in (("last-user", "agent", ""), ("toml-user", "root", '[agent]\nuser = "agent"\n'),
                             ("root-user", "root", "")):
        (top / name / "environment").mkdir(parents=True)
        (top / name / "tests").mkdir()
        (top / name / "instruction.md").write_text("Say hi.\n")
        (top / name / "task.toml").write_text(toml)
        (top / name / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
        (top / name / "environment" / "Dockerfile").write_text(base.format(user))
    handler = get_handler("harbor")
    for task in handler.load(top):  # build the images (cached by content)
        asyncio.run(handler.image(task))
    yield top
    shutil.rmtree(top, ignore_errors=True)


def test_the_agent_runs_as_the_tasks_user_under_a_root_and_an_unprivileged_daemon(user_tasks):
    """uid, gid and HOME (a writable copy of the image's home) are the image user's, for both kinds of daemon;
    a root image user leaves today's unprivileged uid. The containment tests (tests/sandbox) still hold."""
    from support.harbor_rollouts import probe_command

    as_agent = ["1234", "1234", "/home/agent", "hi", "home-writable", "1234"]
    root_out = asyncio.run(probe_command(str(user_tasks), WHO))
    assert root_out["last-user"] == as_agent and root_out["toml-user"] == as_agent
    assert root_out["root-user"][:2] == ["65534", "65534"] and root_out["root-user"][-1] == "65534"
    nobody = pwd.getpwnam(_unprivileged_user()).pw_uid
    user_out = _as_unprivileged_daemon({"ROLLOUTD_TEST_COMMAND": WHO}, tasks=user_tasks)
    assert user_out["last-user"] == as_agent and user_out["toml-user"] == as_agent
    assert user_out["root-user"][0] == str(nobody) != "0"


def test_a_user_the_image_lacks_is_a_config_error(user_tasks, tmp_path):
    from rolloutd.agents.tasks.base import ConfigError

    task = tmp_path / "tasks" / "no-such-user"
    shutil.copytree(user_tasks / "root-user", task)
    (task / "task.toml").write_text('[agent]\nuser = "ghost"\n')
    handler = get_handler("harbor")
    with pytest.raises(ConfigError, match="'ghost'.*does not exist"):
        asyncio.run(handler.sandbox_spec(handler.load(tmp_path / "tasks")[0], SandboxSpec()))


def test_dataset_errors_name_the_task_and_line(tmp_path):
    bad = tmp_path / "tasks" / "bad"
    shutil.copytree(TASKS / "word-count", bad)
    dockerfile = bad / "environment" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "HEALTHCHECK CMD true\n")
    with pytest.raises(DatasetError, match=r"task bad: environment/Dockerfile:12: HEALTHCHECK is not supported"):
        get_handler("harbor").load(tmp_path / "tasks")
    (bad / "tests" / "test.sh").unlink()
    with pytest.raises(DatasetError, match=r"tests/test.sh is missing"):
        get_handler("harbor").load(tmp_path / "tasks")


def test_jsonl_index_and_task_toml_fields(tmp_path):
    index = tmp_path / "index.jsonl"
    index.write_text(json.dumps({"path": str(TASKS / "csv-total"), "id": "orders"}) + "\n\n"
                     + json.dumps({"path": os.path.relpath(TASKS / "word-count", tmp_path)}) + "\n")
    rows = get_handler("harbor").load(index)
    assert [(r["id"], r["agent_timeout"], r["verifier_timeout"]) for r in rows] == [
        ("orders", 300.0, 120.0), ("word-count", 120.0, 60.0)]
    assert rows[0]["config"]["environment"]["memory_mb"] == rows[0]["memory_mb"] == 1024 and rows[1]["memory_mb"] == 1024
    index.write_text('{"id": "x"}\n')
    with pytest.raises(DatasetError, match=r"index.jsonl:1: field 'path'"):
        get_handler("harbor").load(index)


def test_parse_reward():
    assert parse_reward("1\n", None) == 1.0
    assert parse_reward(None, '{"reward": 0.5}') == 0.5
    assert parse_reward(None, '{"accuracy": 1}') == 1.0
    assert parse_reward("yes", None) is None
    assert parse_reward(None, '{"a": 1, "b": 0}') is None
    assert parse_reward(None, None) is None
    assert parse_reward(None, '{"reward": ' + "1" * 5000 + "}") is None  # the sandbox wrote both: each raised
    assert parse_reward(None, "[" * 100_000 + "]" * 100_000) is None


def test_task_memory_becomes_the_sandbox_limit(tmp_path):
    task = tmp_path / "tasks" / "t"
    shutil.copytree(TASKS / "config-port", task)
    toml = (task / "task.toml").read_text()
    (task / "task.toml").write_text(toml + '\n[environment]\nmemory = "2G"\n')
    row = get_handler("harbor").load(tmp_path / "tasks")[0]
    assert row["memory_mb"] == 2048
    (task / "task.toml").write_text(toml + '\n[environment]\nmemory = "lots"\n')
    with pytest.raises(DatasetError, match=r"environment.memory must look like"):
        get_handler("harbor").load(tmp_path / "tasks")
    # what a hostile task.toml may hold (inf and nan were an OverflowError and a ValueError, the others accepted:
    # an rlimit beyond any machine, a verifier never timed out), and TOML that Python cannot read back
    for extra, why in (("[environment]\nmemory_mb = inf", "environment.memory_mb must be a positive number of MB"),
                       ("[environment]\nmemory_mb = nan", "environment.memory_mb must be"),
                       ("[environment]\nmemory_mb = 1e300", "environment.memory_mb must be"),
                       ('[environment]\nmemory = "99999999999G"', "environment.memory must be"),
                       ("[x]\na = " + "[" * 100_000 + "]" * 100_000, "task.toml: nests too deeply"),
                       ("[x]\na = " + "1" * 5000, "task.toml: not valid TOML")):
        (task / "task.toml").write_text(toml + "\n" + extra + "\n")
        with pytest.raises(DatasetError, match=re.escape(why)):
            get_handler("harbor").load(tmp_path / "tasks")
    for value in ("inf", "nan", "1e9"):
        (task / "task.toml").write_text(toml.replace("[verifier]\ntimeout_sec = 60.0", f"[verifier]\ntimeout_sec = {value}"))
        with pytest.raises(DatasetError, match=r"verifier.timeout_sec must be a positive number of seconds, at most"):
            get_handler("harbor").load(tmp_path / "tasks")


def test_a_tasks_memory_over_its_tenants_quota_is_the_jobs_configuration_error(tmp_path):
    """task.toml's memory raises the job's sandbox limit (Harbor gives its container that much): for a tenant, at
    most to its policy's sandboxMemoryMB, which the job's own spec is held to. Before, a tenant's task directory
    walked around the quota; refused before the image is built."""
    task = tmp_path / "tasks" / "t"
    shutil.copytree(TASKS / "config-port", task)
    (task / "task.toml").write_text((task / "task.toml").read_text() + '\n[environment]\nmemory = "8G"\n')
    handler = get_handler("harbor")
    handler.bind(HandlerScope(quotas=TenantQuotas.model_validate({"sandboxMemoryMB": 4096})))
    row = handler.load(tmp_path / "tasks")[0]
    with pytest.raises(ConfigError, match=r"the environment's memory, 8192 MB, is over the tenant's quota of 4096 MB"):
        asyncio.run(handler.sandbox_spec(row, SandboxSpec()))


def test_other_runtimes_are_refused_with_the_reason():
    handler = get_handler("harbor")
    task = handler.load(TASKS)[0]
    with pytest.raises(EvalError, match="sandbox.runtime bwrap"):
        asyncio.run(handler.sandbox_spec(task, SandboxSpec(runtime="process")))


# What a reward-hacking agent leaves behind (its "solution" here, run as the oracle agent in RUN): a wrong
# answer, a loop forging the reward, one planting a passing test file, one killing the verifier, a service.
FORGING_SOLVE = r"""#!/bin/bash
echo '{"orders": 1, "total": 0}' > /app/total.json
nohup bash -c 'while true; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt;
  printf "def test_ok():\n    pass\n" > /tests/test_outputs.py; sleep 0.002; done' > /dev/null 2>&1 &
nohup bash -c 'while true; do pkill -9 -f test_outputs; sleep 0.002; done' > /dev/null 2>&1 &
nohup python3 -m http.server 8765 --bind 127.0.0.1 > /dev/null 2>&1 &
for _ in $(seq 1200); do (exec 3<>/dev/tcp/127.0.0.1/8765) 2>/dev/null && break; sleep 0.05; done  # it serves
"""
SERVICE_TEST = """#!/bin/bash
python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8765/', timeout=5)" \\
  && echo 1 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt
"""


# the loops still running: a child a loop has forked shows the loop's command line until it execs, so
# a process whose parent is a loop is not counted
COUNT_LOOPS = ("python3 -c \"import glob, os\ndef loop(pid):\n    try:\n"
               "        return b'while ' b'true' in open(f'/proc/{pid}/cmdline', 'rb').read()\n"
               "    except OSError:\n        return False\n"
               "def parent(pid):\n    try:\n        return open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[1]\n"
               "    except OSError:\n        return '0'\n"
               "pids = [p.split('/')[2] for p in glob.glob('/proc/[0-9]*/cmdline')]\n"
               "print(sum(loop(p) and not loop(parent(p)) for p in pids))\"")


def _forging_task(tmp_path: Path, test_sh: str | None = None) -> Path:
    task = tmp_path / "tasks" / "csv-total"
    shutil.copytree(TASKS / "csv-total", task)
    (task / "solution" / "solve.sh").write_text(FORGING_SOLVE)
    if test_sh:
        (task / "tests" / "test.sh").write_text(test_sh)
    return tmp_path / "tasks"


def _oracle_then_eval(task: dict):
    from rolloutd.agents.loop.rollout import AgentConfig, RolloutContext

    handler = get_handler("harbor")

    async def main():
        async with task_sandbox(handler, task) as sandbox:
            trajectory = await handler.run(task, sandbox, None, tokenizer=None, config=AgentConfig(agent_kind="oracle"),
                                           ctx=RolloutContext(job="j", prompt=0, sample=0, task_id=task["id"]))
            reward = await handler.eval(task, sandbox, trajectory)
            alive = (await sandbox.bash(COUNT_LOOPS)).output.strip()
            return trajectory, reward, alive
    return asyncio.run(main())


def test_what_the_agent_leaves_running_cannot_forge_plant_or_kill_the_verifier(built, tmp_path):
    """The agent's sessions are confined (Landlock) from RUN on: a wrong answer with a reward forger, a test
    planter and a verifier killer left running scores 0 (on the code before, the forger alone scored 1);
    they were still running through the verifier."""
    task = get_handler("harbor").load(_forging_task(tmp_path))[0]
    trajectory, reward, alive = _oracle_then_eval(task)
    if not trajectory.metrics["agent_confined"]:
        pytest.skip("this kernel has no Landlock: the agent runs unconfined (README: Known gap)")
    assert alive == "2"  # not ended: a service the agent started must keep serving the verifier
    assert reward.value == 0.0 and reward.details["agent_confined"] is True
    output = reward.details["verifier_output"]
    assert " failed" in output and "test_ok" not in output  # the real tests ran (not the planted one) and failed


def test_a_service_the_agent_left_still_serves_the_verifier(built, tmp_path):
    task = get_handler("harbor").load(_forging_task(tmp_path, SERVICE_TEST))[0]
    trajectory, reward, _ = _oracle_then_eval(task)
    assert reward.value == 1.0, reward.details
