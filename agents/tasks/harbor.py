"""The `harbor` task kind: Harbor / Terminal-Bench 2 task directories, unchanged, in images built from
their own Dockerfiles; `agent.kind: oracle` runs the task's `solution/solve.sh` as the agent.

Registered as entry point `harbor`; the node daemon calls `sandbox_spec` (the task's image: built or
reused by `rolloutd.sandbox.image.build`, under a lock, once per node or shared cache), then
`init` / `run` / `eval`. Next step for a task set: validate it with the oracle, then train.

`tasks.source`: a directory of task directories, or a JSON-lines index whose rows name one each
(`{"path": "tasks/hello"}`, relative to the index; optional `"id"`). A task directory holds
`instruction.md`, `task.toml`, `environment/Dockerfile` (+ build context), `tests/test.sh` and
optionally `solution/solve.sh`. task.toml fields read: `[agent] timeout_sec` and `user`, `[verifier] timeout_sec`
and `env`, `[solution] env`, `[environment] memory_mb` (or `memory = "2G"`: the sandbox's memory limit
instead of the job's) and `allow_internet`; the rest is kept in the row (`config`). Every file of it is read beneath the job's data
roots (harbor_files.py: `load` takes them, the node gives its handler `scope.roots`), never as root.

In the sandbox (see image_build.py): everything runs as the task's user (`[agent] user`, else the Dockerfile's
last USER) when that is not root, else as the runtime's unprivileged user; WORKDIR is the workspace; `/logs`, `/tests`, `/solution` live
in the control directory (`/logs/agent` links to /tmp), which the agent's sessions, confined from RUN on
(sandbox/server/confine.py), cannot write. EVAL copies `tests/` to `/tests` (replacing whatever is there), runs
`bash /tests/test.sh` in a shell of its own with the verifier's timeout, and reads
`/logs/verifier/reward.txt` (or `reward.json`). A verifier that leaves no reward, crashes, or times
out is an infrastructure failure (`EvalError`), never reward 0. The verifier has no network unless the job
consents (`sandbox.verifierNetwork`) and the task allows it (`[environment] allow_internet`, default true):
then it gets an egress proxy (agents/gateway/egress.py) once the agent's processes are gone.
"""
from __future__ import annotations

import asyncio
import json
import re
import shlex
from pathlib import Path
from typing import Any, ClassVar, Sequence

from rolloutd.crds.kit.safe_read import DataReadError, kind as path_kind
from rolloutd.crds.kit.settings import SandboxSettings
from rolloutd.crds.trajectory import Trajectory

from .base import ConfigError, DatasetError, EvalError, Reward, TaskHandler, refused, stash_answer
from .harbor_files import EVAL_SESSION, HARBOR_ROOT, bash_ok as _bash_ok, read_task, snapshot, stage_dir, task_dirs
from .leftovers import confine_agent, end_agent_processes
from .seams import LLM, AgentConfig, HostSandbox, RolloutContext, Sandbox, SandboxFactory, Tokenizer

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
    def load(self, source: str | Path, limit: int | None = None, *, roots: Sequence[str] | None = None) -> list[dict]:
        """Rows of the task directories of `source`, read beneath `roots` (harbor_files.py)."""
        rows, seen = [], set()
        for task_id, task_dir, where in task_dirs(source, roots)[:limit]:
            row = read_task(task_dir, task_id, where, roots)
            if task_id in seen:
                raise DatasetError(f"{where}: field 'id': duplicate id")
            seen.add(task_id)
            rows.append(row)
        return rows

    def messages(self, task: dict, tools: list[str]) -> list[dict]:
        return [{"role": "system", "content": SYSTEM_PROMPT.format(workdir=task.get("workdir") or "/workspace")},
                {"role": "user", "content": task["instruction"]}]

    # ------------------------------------------------------------------ INIT
    async def sandbox_spec(self, task: dict, base: Any) -> Any:
        """The job's sandbox spec with the task's own image and its Dockerfile's ENV."""
        if base.runtime != "bwrap":
            raise EvalError(f"harbor tasks run on sandbox.runtime bwrap (their images are root filesystems), "
                            f"not {base.runtime!r}")
        self._task_dir(task)  # the node checks again: the task's directory lies beneath the job's data roots
        quotas = self.scope.quotas
        if quotas is not None and (task.get("memory_mb") or 0) > quotas.sandbox_memory_mb:  # the task's own need
            raise ConfigError(f"spec.tasks.source: {task['path']}/task.toml: the environment's memory, "
                              f"{task['memory_mb']} MB, is over the tenant's quota of {quotas.sandbox_memory_mb} MB "
                              "(sandboxMemoryMB)")
        image = await self.image(task)
        task["workdir"] = image.workdir if image.writable_workdir else "/workspace"
        # the verifier's egress: only with the job's consent, and only for a task that allows the internet
        task["verifier_network"] = bool(base.verifier_network and task.get("allow_internet", True))
        update = {"image": str(image.rootfs), "env": {**image.env, **base.env},
                  "user": run_as(image, task.get("agent_user") or image.user, task["id"]) or base.user}
        if task.get("memory_mb"):  # the task's declared need, as Harbor gives its container
            update["limits"] = base.limits.model_copy(update={"memory_mb": task["memory_mb"]})
        return base.model_copy(update=update)

    def _task_dir(self, task: dict) -> str:
        """The task's directory, refused (`ConfigError`, the job's fault) unless it lies beneath `self.scope.roots`."""
        try:
            if path_kind(task["path"], self.scope.roots) != "dir":
                raise ConfigError(f"spec.tasks.source: {task['path']}: the task directory is gone")
        except DataReadError as e:
            raise ConfigError(str(refused(e))) from None
        return str(task["path"]).rstrip("/")

    async def image(self, task: dict) -> Any:
        """The task's image, built at most once per handler at a time (and once per cache, by its lock)."""
        from rolloutd.sandbox.image.build import build_image  # the sandbox side, imported where needed

        path = task["path"]
        future = self._builds.get(path)
        if future is None or (future.done() and future.exception() is not None):
            future = asyncio.ensure_future(asyncio.to_thread(self._build, build_image, path))
            self._builds[path] = future
        return await asyncio.shield(future)  # an INIT timeout leaves the build running for the retry

    def _build(self, build_image: Any, path: str) -> Any:
        """An admin's task builds from its directory; a tenant's from a private copy of it read beneath the job's
        data roots as nobody (`snapshot`), so the builder, which reads the Dockerfile and hashes and copies the
        context as root, never reads through a link out of the tenant's data or a file the tenant cannot read."""
        from rolloutd.sandbox.image.build_limits import for_build

        scope = self.scope
        bounds = for_build(scope.sandbox_settings, scope.quotas)  # a tenant's: at most its policy's sandbox quotas
        if scope.roots is None:
            return build_image(path, cache=self.image_cache, log=lambda _m: None, settings=scope.sandbox_settings,
                               bounds=bounds)
        with snapshot(path, scope.roots) as private:
            return build_image(private, cache=self.image_cache, log=lambda _m: None, settings=scope.sandbox_settings,
                               bounds=bounds)

    async def init(self, task: dict, sandbox: HostSandbox | None) -> None:
        image = await self.image(task)
        await asyncio.to_thread(image.seed_workspace, Path(sandbox.workspace))
        await asyncio.to_thread(sandbox.give, sandbox.workspace)  # before any agent code: no path to race
        await _bash_ok(sandbox, f"mkdir -p {HARBOR_ROOT}/logs/verifier {HARBOR_TMP}/logs-agent && "
                                f"ln -sfn {HARBOR_TMP}/logs-agent {HARBOR_ROOT}/logs/agent", "prepare /logs", 30)

    # ------------------------------------------------------------------ RUN
    async def run(self, task: dict, sandbox: HostSandbox | None, llm: LLM | None, *, tokenizer: Tokenizer | None,
                  config: AgentConfig, ctx: RolloutContext) -> Trajectory:
        confined = await confine_agent(sandbox, EVAL_SESSION, "harbor")
        trajectory = await self._run(task, sandbox, llm, tokenizer=tokenizer, config=config, ctx=ctx)
        trajectory.metrics["agent_confined"] = confined
        return trajectory

    async def _run(self, task: dict, sandbox: HostSandbox, llm: LLM | None, *, tokenizer: Tokenizer | None,
                   config: AgentConfig, ctx: RolloutContext) -> Trajectory:
        kind = getattr(config, "agent_kind", "loop")
        if kind == "harness":
            from .harness import run_harness  # the gateway's side: only harness jobs load it

            return await run_harness(task, sandbox, llm, tokenizer=tokenizer, config=config, ctx=ctx,
                                     workdir=task.get("workdir", "/workspace"),
                                     timeout=_limit(task["agent_timeout"], getattr(config, "run_timeout", None)))
        if kind != "oracle":
            return await super().run(task, sandbox, llm, tokenizer=tokenizer, config=config, ctx=ctx)
        solution = f"{self._task_dir(task)}/solution"
        try:
            has_solution = path_kind(f"{solution}/solve.sh", self.scope.roots) == "file"
        except DataReadError as e:
            raise ConfigError(str(refused(e))) from None
        if not has_solution:
            raise EvalError(f"harbor: task {task['id']} has no solution/solve.sh for the oracle agent")
        await stage_dir(sandbox, solution, "/solution", self.scope.roots)
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
    async def eval(self, task: dict, sandbox: HostSandbox | None, trajectory: Trajectory, *,
                   sandbox_factory: SandboxFactory | None = None) -> Reward:
        if sandbox is None:
            raise EvalError("harbor: eval needs the rollout's sandbox")
        egress = None
        try:
            await _bash_ok(sandbox, f"rm -rf {HARBOR_ROOT}/tests && rm -f /logs/verifier/reward.txt "
                                    "/logs/verifier/reward.json && mkdir -p /logs/verifier", "prepare /tests", 60)
            await stage_dir(sandbox, f"{self._task_dir(task)}/tests", "/tests", self.scope.roots)
            exports = _exports(task.get('verifier_env', {}))
            if task.get("verifier_network"):
                egress = await _open_egress(sandbox, self.scope.sandbox_settings)
                exports += _exports({k: f"http://127.0.0.1:{EGRESS_PORT}" for k in PROXY_VARS})
            run = await sandbox.bash(f"{exports}cd "
                                     f"{shlex.quote(task.get('workdir', '/workspace'))} && bash /tests/test.sh "
                                     f"> /logs/verifier/test-output.txt 2>&1; echo \"verifier-exit=$?\"",
                                     timeout=task["verifier_timeout"], **EVAL_SESSION)
        except (EvalError, ConfigError):
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
    from rolloutd.sandbox.image.rootfs import ImageBuildError, lookup_user

    if not user:
        return None
    try:
        uid, _ = lookup_user(image.rootfs, user)
    except ImageBuildError as e:
        raise ConfigError(f"spec.tasks.source: task {task_id}: the agent's user {user!r}: {e}") from None
    return user if uid != 0 else None


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
        except (ValueError, RecursionError):  # the sandbox wrote it: not JSON, or JSON Python cannot read
            return None
        if isinstance(data, dict):
            value = data.get("reward", next(iter(data.values())) if len(data) == 1 else None)
            return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return None


async def _open_egress(sandbox: HostSandbox, settings: SandboxSettings | None = None) -> Any:
    """The verifier's egress proxy, served on the sandbox's loopback; every process the agent left is
    killed first (`kill -1`: all but this shell and the server, pid 1), so none of them ever uses it.
    `settings`: the node's sandbox settings (their `egress_allow`; None: no exception)."""
    from rolloutd.agents.gateway.egress import EgressProxy
    from rolloutd.agents.gateway.server import start_relay

    await end_agent_processes(sandbox, EVAL_SESSION, "harbor")
    egress = EgressProxy(settings.egress_allow if settings is not None else ())
    await egress.start(Path(sandbox.root) / "ctl" / "egress.sock")
    try:
        await start_relay(sandbox, "/.rolloutd/egress.sock", EGRESS_PORT, "/tmp/.harbor/egress.log", EVAL_SESSION)
    except BaseException:
        await egress.stop()
        raise
    return egress


async def _read(sandbox: Sandbox, path: str, *, tail: bool = False) -> str | None:
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



__all__ = ["HarborTask", "parse_reward", "read_task", "stage_dir"]
