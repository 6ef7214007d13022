"""The `harbor` task kind: Harbor / Terminal-Bench 2 task directories, unchanged, in images built from
their own Dockerfiles; `agent.kind: oracle` runs the task's `solution/solve.sh` as the agent.

Registered as entry point `harbor`; the node daemon calls `sandbox_spec` (the task's image: built or
reused by `rolloutd.sandbox.image_build`, under a lock, once per node or shared cache), then
`init` / `run` / `eval`. Next step for a task set: validate it with the oracle, then train.

`tasks.source`: a directory of task directories, or a JSON-lines index whose rows name one each
(`{"path": "tasks/hello"}`, relative to the index; optional `"id"`). A task directory holds
`instruction.md`, `task.toml`, `environment/Dockerfile` (+ build context), `tests/test.sh` and
optionally `solution/solve.sh`. task.toml fields read: `[agent] timeout_sec` and `user`, `[verifier] timeout_sec`
and `env`, `[solution] env`, `[environment] memory_mb` (or `memory = "2G"`: the sandbox's memory limit
instead of the job's) and `allow_internet`; the rest is kept in the row (`config`).

In the sandbox (see image_build.py): everything runs as the task's user (`[agent] user`, else the Dockerfile's
last USER) when that is not root, else as the runtime's unprivileged user; WORKDIR is the workspace; `/logs`, `/tests`, `/solution` live
in the control directory (`/logs/agent` links to /tmp), which the agent's sessions, confined from RUN on
(sandbox/server/confine.py), cannot write. EVAL copies `tests/` to `/tests` (replacing whatever is there), runs
`bash /tests/test.sh` in a shell of its own with the verifier's timeout, and reads
`/logs/verifier/reward.txt` (or `reward.json`). A verifier that leaves no reward, crashes, or times
out is an infrastructure failure (`EvalError`), never reward 0. The verifier has no network unless the job
consents (`sandbox.verifierNetwork`) and the task allows it (`[environment] allow_internet`, default true):
then it gets an egress proxy (agents/egress.py) once the agent's processes are gone.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shlex
import shutil
import tempfile
import tomllib
from pathlib import Path
from typing import Any, ClassVar

from rolloutd.crds.trajectory import Trajectory

from .base import ConfigError, DatasetError, EvalError, Reward, TaskHandler, json_lines, stash_answer
from .leftovers import confine_agent, end_agent_processes

REQUIRED = ("instruction.md", "environment/Dockerfile", "tests/test.sh")
AGENT_TIMEOUT = 600.0      # Harbor's defaults when task.toml says nothing
VERIFIER_TIMEOUT = 600.0
EVAL_SESSION = {"session": "rolloutd-harbor-eval"}  # never confined: the verifier's
HARBOR_ROOT = "/.rolloutd/harbor"  # where the image's /logs, /tests, /solution point (sandbox/image_build.py)
HARBOR_TMP = "/tmp/.harbor"        # the agent's side: /logs/agent, the instruction, the relay's log
EGRESS_PORT = 41401  # the verifier's proxy, on the sandbox's own loopback
PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
SYSTEM_PROMPT = ("You are an agent working in a Linux terminal. Complete the task below; your working "
                 "directory is {workdir}. When you are done, say so.")


class HarborTask(TaskHandler):
    name: ClassVar[str] = "harbor"
    agent_kinds: ClassVar[tuple[str, ...]] = ("loop", "oracle", "harness")
    needs_sandbox: ClassVar[bool] = True

    def __init__(self, *, image_cache: str | None = None) -> None:
        self.image_cache = image_cache
        self._builds: dict[str, asyncio.Future] = {}

    # ------------------------------------------------------------------ dataset
    def load(self, source: str | Path, limit: int | None = None) -> list[dict]:
        path = Path(source)
        if path.is_dir():
            dirs = [(d.name, d) for d in sorted(path.iterdir()) if d.is_dir() and not d.name.startswith(".")]
            where = {d: f"{path}: task {d.name}" for _, d in dirs}
            if not dirs:
                raise DatasetError(f"{path}: no task directories")
        elif path.is_file():
            dirs, where = self._index(path)
        else:
            raise DatasetError(f"{path}: neither a directory of tasks nor a JSON-lines index")
        rows, seen = [], set()
        for task_id, task_dir in dirs[:limit]:
            row = read_task(task_dir, task_id, where[task_dir])
            if task_id in seen:
                raise DatasetError(f"{where[task_dir]}: field 'id': duplicate id {task_id!r}")
            seen.add(task_id)
            rows.append(row)
        return rows

    @staticmethod
    def _index(path: Path) -> tuple[list[tuple[str, Path]], dict[Path, str]]:
        dirs, where = [], {}
        for _, at, row in json_lines(path):
            if not isinstance(row, dict) or not isinstance(row.get("path"), str):
                raise DatasetError(f"{at}: field 'path' (a task directory) is required")
            task_dir = (path.parent / row["path"]).resolve()
            dirs.append((str(row.get("id") or task_dir.name), task_dir))
            where[task_dir] = at
        return dirs, where

    def messages(self, task: dict, tools: list[str]) -> list[dict]:
        return [{"role": "system", "content": SYSTEM_PROMPT.format(workdir=task.get("workdir") or "/workspace")},
                {"role": "user", "content": task["instruction"]}]

    # ------------------------------------------------------------------ INIT
    async def sandbox_spec(self, task: dict, base: Any) -> Any:
        """The job's sandbox spec with the task's own image and its Dockerfile's ENV."""
        if base.runtime != "bwrap":
            raise EvalError(f"harbor tasks run on sandbox.runtime bwrap (their images are root filesystems), "
                            f"not {base.runtime!r}")
        image = await self.image(task)
        task["workdir"] = image.workdir if image.writable_workdir else "/workspace"
        # the verifier's egress: only with the job's consent, and only for a task that allows the internet
        task["verifier_network"] = bool(base.verifier_network and task.get("allow_internet", True))
        update = {"image": str(image.rootfs), "env": {**image.env, **base.env},
                  "user": run_as(image, task.get("agent_user") or image.user, task["id"]) or base.user}
        if task.get("memory_mb"):  # the task's declared need, as Harbor gives its container
            update["limits"] = base.limits.model_copy(update={"memory_mb": task["memory_mb"]})
        return base.model_copy(update=update)

    async def image(self, task: dict) -> Any:
        """The task's image, built at most once per handler at a time (and once per cache, by its lock)."""
        from rolloutd.sandbox.image_build import build_image  # the sandbox side, imported where needed

        path = task["path"]
        future = self._builds.get(path)
        if future is None or (future.done() and future.exception() is not None):
            future = asyncio.ensure_future(asyncio.to_thread(build_image, path, cache=self.image_cache,
                                                             log=lambda _m: None))
            self._builds[path] = future
        return await asyncio.shield(future)  # an INIT timeout leaves the build running for the retry

    async def init(self, task: dict, sandbox: Any) -> None:
        image = await self.image(task)
        await asyncio.to_thread(image.seed_workspace, Path(sandbox.workspace))
        await asyncio.to_thread(sandbox.give, sandbox.workspace)  # before any agent code: no path to race
        await _bash_ok(sandbox, f"mkdir -p {HARBOR_ROOT}/logs/verifier {HARBOR_TMP}/logs-agent && "
                                f"ln -sfn {HARBOR_TMP}/logs-agent {HARBOR_ROOT}/logs/agent", "prepare /logs", 30)

    # ------------------------------------------------------------------ RUN
    async def run(self, task: dict, sandbox: Any, llm: Any, *, tokenizer: Any, config: Any, ctx: Any) -> Trajectory:
        confined = await confine_agent(sandbox, EVAL_SESSION, "harbor")
        trajectory = await self._run(task, sandbox, llm, tokenizer=tokenizer, config=config, ctx=ctx)
        trajectory.metrics["agent_confined"] = confined
        return trajectory

    async def _run(self, task: dict, sandbox: Any, llm: Any, *, tokenizer: Any, config: Any, ctx: Any) -> Trajectory:
        kind = getattr(config, "agent_kind", "loop")
        if kind == "harness":
            from .harness import run_harness  # the gateway's side: only harness jobs load it

            return await run_harness(task, sandbox, llm, tokenizer=tokenizer, config=config, ctx=ctx,
                                     workdir=task.get("workdir", "/workspace"),
                                     timeout=_limit(task["agent_timeout"], getattr(config, "run_timeout", None)))
        if kind != "oracle":
            return await super().run(task, sandbox, llm, tokenizer=tokenizer, config=config, ctx=ctx)
        solution = Path(task["path"]) / "solution"
        if not (solution / "solve.sh").is_file():
            raise EvalError(f"harbor: task {task['id']} has no solution/solve.sh for the oracle agent")
        await stage_dir(sandbox, solution, "/solution")
        timeout = _limit(task["agent_timeout"], getattr(config, "run_timeout", None))
        env = _exports(task.get("solution_env", {}))
        result = await sandbox.bash(f"{env}cd {shlex.quote(task.get('workdir', '/workspace'))} && "
                                    f"bash /solution/solve.sh > /logs/agent/oracle.txt 2>&1; echo \"oracle-exit=$?\"",
                                    timeout=timeout)
        m = re.search(r"oracle-exit=(\d+)", result.output)
        trajectory = Trajectory(job=ctx.job, prompt=ctx.prompt, sample=ctx.sample, task_id=ctx.task_id,
                                node=ctx.node, attempt=ctx.attempt, finish_reason="oracle",
                                messages=self.messages(task, []))
        trajectory.metrics = {"oracle_exit": int(m.group(1)) if m else None, "oracle_timed_out": result.timed_out}
        return stash_answer(trajectory, submitted=None, final_text="")

    # ------------------------------------------------------------------ EVAL
    async def eval(self, task: dict, sandbox: Any, trajectory: Trajectory) -> Reward:
        if sandbox is None:
            raise EvalError("harbor: eval needs the rollout's sandbox")
        egress = None
        try:
            await _bash_ok(sandbox, f"rm -rf {HARBOR_ROOT}/tests && rm -f /logs/verifier/reward.txt "
                                    "/logs/verifier/reward.json && mkdir -p /logs/verifier", "prepare /tests", 60)
            await stage_dir(sandbox, Path(task["path"]) / "tests", "/tests")
            exports = _exports(task.get('verifier_env', {}))
            if task.get("verifier_network"):
                egress = await _open_egress(sandbox)
                exports += _exports({k: f"http://127.0.0.1:{EGRESS_PORT}" for k in PROXY_VARS})
            run = await sandbox.bash(f"{exports}cd "
                                     f"{shlex.quote(task.get('workdir', '/workspace'))} && bash /tests/test.sh "
                                     f"> /logs/verifier/test-output.txt 2>&1; echo \"verifier-exit=$?\"",
                                     timeout=task["verifier_timeout"], **EVAL_SESSION)
        except EvalError:
            raise
        except Exception as e:  # noqa: BLE001 - the sandbox failed us: infrastructure
            raise EvalError(f"harbor: cannot run the verifier: {e!r}") from e
        finally:
            if egress is not None:
                await egress.stop()
        log = await _read(sandbox, "/logs/verifier/test-output.txt", tail=True) or ""
        if run.timed_out:
            raise EvalError(f"harbor: the verifier did not finish within {task['verifier_timeout']:g}s: {log[-1000:]}")
        m = re.search(r"verifier-exit=(\d+)", run.output)
        details: dict[str, Any] = {"verifier_exit": int(m.group(1)) if m else None, "verifier_output": log[-3000:],
                                   "verifier_network": bool(task.get("verifier_network")),
                                   "agent_confined": trajectory.metrics.get("agent_confined")}
        value = parse_reward(await _read(sandbox, "/logs/verifier/reward.txt"),
                             await _read(sandbox, "/logs/verifier/reward.json"))
        if value is None:
            raise EvalError(f"harbor: the verifier wrote no reward to /logs/verifier/reward.txt "
                            f"(exit {details['verifier_exit']}): {log[-1500:]}")
        return Reward(value=value, details=details)


def run_as(image: Any, user: str | None, task_id: str) -> str | None:
    """The task's user (task.toml `[agent] user`, else the Dockerfile's last USER) when it is not root: the
    sandbox runs as it. One the image lacks is the job's configuration at fault, never the policy's."""
    from rolloutd.sandbox.rootfs import ImageBuildError, lookup_user

    if not user:
        return None
    try:
        uid, _ = lookup_user(image.rootfs, user)
    except ImageBuildError as e:
        raise ConfigError(f"spec.tasks.source: task {task_id}: the agent's user {user!r}: {e}") from None
    return user if uid != 0 else None


# ---------------------------------------------------------------------- task directories
def read_task(task_dir: Path, task_id: str, where: str) -> dict:
    """One dataset row from a Harbor task directory; `DatasetError` names what is wrong."""
    from rolloutd.sandbox.dockerfile import DockerfileError, load_dockerfile

    for rel in REQUIRED:
        if not (task_dir / rel).is_file():
            raise DatasetError(f"{where}: {task_dir / rel} is missing (a Harbor task needs {', '.join(REQUIRED)})")
    config: dict[str, Any] = {}
    if (task_dir / "task.toml").is_file():
        try:
            config = tomllib.loads((task_dir / "task.toml").read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise DatasetError(f"{where}: {task_dir / 'task.toml'}: {e}") from None
    try:
        load_dockerfile(task_dir / "environment" / "Dockerfile")  # out-of-subset lines fail here, at submission
    except DockerfileError as e:
        raise DatasetError(f"{where}: environment/{e}") from None
    section = lambda name: config.get(name) if isinstance(config.get(name), dict) else {}  # noqa: E731
    return {
        "id": task_id,
        "path": str(task_dir.resolve()),
        "instruction": (task_dir / "instruction.md").read_text(encoding="utf-8"),
        "agent_timeout": _seconds(section("agent").get("timeout_sec", AGENT_TIMEOUT), where, "agent.timeout_sec"),
        "verifier_timeout": _seconds(section("verifier").get("timeout_sec", VERIFIER_TIMEOUT), where,
                                     "verifier.timeout_sec"),
        "verifier_env": _env(section("verifier").get("env", {}), where, "verifier.env"),
        "solution_env": _env(section("solution").get("env", {}), where, "solution.env"),
        "memory_mb": _memory_mb(section("environment"), where),
        "agent_user": _user(section("agent").get("user"), where),
        "allow_internet": _flag(section("environment").get("allow_internet", True), where, "environment.allow_internet"),
        "config": config,
    }


def parse_reward(text: str | None, json_text: str | None) -> float | None:
    """Harbor's reward: a number in reward.txt, else `reward` (or the only value) of reward.json."""
    if text is not None and text.strip():
        try:
            return float(text.strip())
        except ValueError:
            return None
    if json_text:
        try:
            data = json.loads(json_text)
        except json.JSONDecodeError:
            return None
        if isinstance(data, dict):
            value = data.get("reward", next(iter(data.values())) if len(data) == 1 else None)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return None


async def stage_dir(sandbox: Any, source: Path, target: str) -> None:
    """Copy a host directory to `target` inside the sandbox (binary-safe: through the workspace, then copied
    by the sandbox's own user, so that the files are its own whatever uid it runs as)."""
    name = f".rolloutd-stage-{secrets.token_hex(6)}"
    staging = Path(sandbox.workspace) / name
    await asyncio.to_thread(_copy_fresh, source, staging)
    inner = shlex.quote(f"{HARBOR_ROOT}{target}")
    try:
        await _bash_ok(sandbox, f"rm -rf {inner} && cp -R --preserve=mode,timestamps /workspace/{name} {inner}",
                       f"stage {target}", 60)
    finally:
        await asyncio.to_thread(shutil.rmtree, staging, True)


def _copy_fresh(source: Path, staging: Path) -> None:
    """Copy `source` to `staging`, readable by any uid. Prepared beside the workspace (sandboxed code cannot
    reach it there), then renamed in whole, so that no host step touches a path sandboxed code could swap."""
    private = Path(tempfile.mkdtemp(dir=staging.parent.parent))
    try:
        tree = private / "tree"
        shutil.copytree(source, tree, symlinks=True)
        for dirpath, dirnames, filenames in os.walk(tree):
            os.chmod(dirpath, os.stat(dirpath).st_mode | 0o555)
            for name in filenames:
                path = os.path.join(dirpath, name)
                if not os.path.islink(path):
                    os.chmod(path, os.stat(path).st_mode | 0o444)
        os.rename(tree, staging)  # fails on anything but an empty directory planted at that fresh name
    finally:
        shutil.rmtree(private, ignore_errors=True)


async def _open_egress(sandbox: Any) -> Any:
    """The verifier's egress proxy, served on the sandbox's loopback; every process the agent left is
    killed first (`kill -1`: all but this shell and the server, pid 1), so none of them ever uses it."""
    from rolloutd.agents.egress import EgressProxy
    from rolloutd.agents.gateway import start_relay

    await end_agent_processes(sandbox, EVAL_SESSION, "harbor")
    egress = EgressProxy()
    await egress.start(Path(sandbox.root) / "ctl" / "egress.sock")
    try:
        await start_relay(sandbox, "/.rolloutd/egress.sock", EGRESS_PORT, "/tmp/.harbor/egress.log", EVAL_SESSION)
    except BaseException:
        await egress.stop()
        raise
    return egress


async def _bash_ok(sandbox: Any, command: str, what: str, timeout: float) -> None:
    result = await sandbox.bash(command, timeout=timeout, **EVAL_SESSION)
    if result.timed_out or result.exit_code != 0:
        raise EvalError(f"harbor: {what} failed in the sandbox: {result.output[-1000:]}")


async def _read(sandbox: Any, path: str, *, tail: bool = False) -> str | None:
    """A regular file's first (`tail`: last) 64 KiB, the verifier's output being the agent's to inflate; None
    when there is none (the server refuses a missing file, a directory, a FIFO or a device)."""
    from rolloutd.sandbox.errors import ExecError
    try:
        return await sandbox.read_file(path, max_bytes=1 << 16, tail=tail)
    except ExecError:
        return None


def _exports(env: dict[str, str]) -> str:
    return "".join(f"export {k}={shlex.quote(v)}; " for k, v in env.items())


def _limit(task_seconds: float, run_timeout: float | None) -> float:
    return min(task_seconds, run_timeout) if run_timeout else task_seconds


def _seconds(value: Any, where: str, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise DatasetError(f"{where}: task.toml {field} must be a positive number of seconds, got {value!r}")
    return float(value)


def _memory_mb(environment: dict, where: str) -> int | None:
    """[environment] memory_mb, or the older `memory = "4G"` spelling; None when absent."""
    if "memory_mb" in environment:
        return int(_seconds(environment["memory_mb"], where, "environment.memory_mb"))
    memory = environment.get("memory")
    if memory is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([MG])i?B?\s*", str(memory), re.I)
    if not m:
        raise DatasetError(f"{where}: task.toml environment.memory must look like '2G' or '512M', got {memory!r}")
    return int(float(m.group(1)) * (1024 if m.group(2).upper() == "G" else 1))


def _flag(value: Any, where: str, field: str) -> bool:
    if not isinstance(value, bool):
        raise DatasetError(f"{where}: task.toml {field} must be true or false, got {value!r}")
    return value


def _user(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, int)) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]*)?",
                                                               str(value)):
        raise DatasetError(f"{where}: task.toml agent.user must be a user name or uid[:group], got {value!r}")
    return str(value)


def _env(value: Any, where: str, field: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and re.fullmatch(r"[A-Za-z_]\w*", k)
                                              for k in value):
        raise DatasetError(f"{where}: task.toml {field} must be a table of NAME = value")
    return {k: str(v) for k, v in value.items()}


__all__ = ["HarborTask", "parse_reward", "read_task", "stage_dir"]
