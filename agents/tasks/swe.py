"""The `swe` task kind: fix an issue in a git repository; EVAL replays the agent's diff in a FRESH
sandbox and runs the repository's tests (SWE-bench semantics).

Registered as entry point `swe` (see `registry.get_handler`); the node daemon's INIT/RUN/EVAL pools call
`SweTask.init` / `run` / `eval`. Sandboxes come from `rolloutd.sandbox`.

Rows: SWE-bench's fields `instance_id`, `problem_statement`, `base_commit`, `FAIL_TO_PASS`,
`PASS_TO_PASS` (lists of pytest node ids, or SWE-bench's JSON-encoded strings of them),
`test_patch`, plus `repo_path` (a git repository — bare or not — or a tarball of one; relative paths
are taken from the dataset file's folder and made absolute by `load`) and `test_command` (a shell
command run in the repository with the test ids appended; `{python}` in it becomes the handler's
interpreter), and optionally `timeout` (seconds for the test run, at most a week). Extra fields (`patch`,
`repo`, `hints_text`, ...) are kept.

INIT stages the tree of `base_commit` at `/workspace/repo` as a fresh one-commit repository (no
history, so the fix cannot be read from the log), built host-side with `git archive` into the
sandbox's `workspace` before the agent starts. A tenant's `repo_path` lies beneath the job's data roots
(`roots`) and its git runs as nobody on a root node (crds/kit/safe_read.py). The commit is deterministic, so EVAL can rebuild it.
The staging and the agent's diff are `swe_repo.py`'s; this module is the handler and its scoring.

EVAL:
1. the agent's diff: `git add -A && git diff --cached <staged commit>` run INSIDE the RUN sandbox
   (git never runs on the host over a repository the agent controlled), read back with `read_file`;
2. a FRESH sandbox (see below), the same staging, `git apply` of the agent's diff (a diff that does
   not apply scores 0), the files touched by `test_patch` reset to base, `test_patch` applied;
3. `test_command FAIL_TO_PASS... PASS_TO_PASS...`, its `-rA` summary parsed (PASSED/XFAIL = pass).
Reward 1 only when every FAIL_TO_PASS test passes and no PASS_TO_PASS test breaks. `details` holds
the patch, the per-test outcomes and the log tail.

Where the fresh sandbox comes from, first match wins:
- `eval(..., sandbox_factory=f)`: a `seams.SandboxFactory`, returning a new sandbox (the node daemon passes
  one, started as RUN ends, because `eval_sandbox` is set);
- `SweTask(sandbox_factory=f)` (e.g. `get_handler("swe", sandbox_factory=f)`);
- `SweTask(runtime=r, spec=s)`: `await r.create(s)`;
- the RUN sandbox's own `spec` (a `rolloutd.sandbox` `SandboxSpec`: same image, runtime and limits),
  created through its `runtime` attribute if it has one, else `rolloutd.sandbox.get_runtime(spec.runtime)`.
Without any, EVAL raises `EvalError` (an infrastructure failure, never reward 0). The factory must
return a sandbox of the same image as the RUN one; EVAL closes it.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, ClassVar

from rolloutd.crds.kit.safe_read import DataReadError, kind as path_kind
from rolloutd.crds.trajectory import Trajectory

from .base import EvalError, Reward, TaskHandler, check_timeout, checked_exit, refused
from .seams import HostSandbox, Sandbox, SandboxFactory
from .swe_repo import EVAL_DIR, REPO, SAFE_GIT, SESSION, agent_diff, stage_in_sandbox


MAX_PATCH_BYTES = 2_000_000

SYSTEM_PROMPT = (
    "You are a software engineer fixing an issue in a Python repository. Explore the code, make the "
    "smallest change that resolves the issue, and check it by running the tests. Do not change the "
    "existing tests. When you are done, say so."
)

_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\s+(\S+)", re.M)


class SweTask(TaskHandler):
    name: ClassVar[str] = "swe"
    needs_sandbox: ClassVar[bool] = True
    eval_sandbox: ClassVar[bool] = True   # the tests run in a fresh checkout, not the agent's sandbox
    id_field: ClassVar[str] = "instance_id"
    fields: ClassVar[dict] = {
        "instance_id": str, "problem_statement": str, "base_commit": str,
        "FAIL_TO_PASS": (list, str), "PASS_TO_PASS": (list, str), "test_patch": str,
        "repo_path": str, "test_command": str,
    }

    def __init__(self, *, sandbox_factory: SandboxFactory | None = None, runtime: Any = None, spec: Any = None,
                 python: str | None = None, timeout: float = 300.0, system_prompt: str = SYSTEM_PROMPT) -> None:
        self.sandbox_factory = sandbox_factory
        self.runtime = runtime
        self.spec = spec
        self.python = python or sys.executable
        self.timeout = timeout
        self.system_prompt = system_prompt

    # ------------------------------------------------------------------ dataset
    def load(self, source: str | Path, limit: int | None = None, *, roots: Any = None) -> list[dict]:
        """The base's load, then each `repo_path` (made absolute, links resolved) must lie beneath `roots`."""
        rows = super().load(source, limit, roots=roots)
        for row in rows if roots is not None else ():
            try:
                path_kind(row["repo_path"], roots)
            except DataReadError as e:
                raise refused(e, f"{source}: task {row[self.id_field]}: field 'repo_path'") from None
        return rows

    def validate_row(self, row: dict, *, base_dir: Path) -> None:
        for key in ("FAIL_TO_PASS", "PASS_TO_PASS"):
            value = row[key]
            if isinstance(value, str):  # SWE-bench on Hugging Face stores these JSON-encoded
                try:
                    value = json.loads(value)
                except (ValueError, RecursionError):
                    raise ValueError(f"field '{key}' is a string but not a JSON list") from None
            if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
                raise ValueError(f"field '{key}' must be a list of test ids")
            row[key] = value
        if not row["FAIL_TO_PASS"]:
            raise ValueError("field 'FAIL_TO_PASS' is empty: nothing would show the fix")
        if not re.fullmatch(r"[0-9a-fA-F]{7,40}", row["base_commit"]):
            raise ValueError("field 'base_commit' must be a commit id (7 to 40 hex digits)")
        repo = Path(row["repo_path"])
        repo = repo if repo.is_absolute() else (base_dir / repo).resolve()
        if not repo.exists():
            raise ValueError(f"field 'repo_path': {repo} does not exist")
        row["repo_path"] = str(repo)
        check_timeout(row)

    def messages(self, task: dict, tools: list[str]) -> list[dict]:
        user = (f"The repository is checked out at {REPO}. Resolve this issue:\n\n"
                f"{task['problem_statement'].strip()}\n\n"
                f"Edit the files in {REPO}; your changes are collected with `git diff` when you finish.")
        return [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": user}]

    # ------------------------------------------------------------------ INIT
    async def init(self, task: dict, sandbox: HostSandbox | None) -> None:
        await stage_in_sandbox(task, sandbox, self.scope.roots)

    # ------------------------------------------------------------------ EVAL
    async def eval(self, task: dict, sandbox: HostSandbox | None, trajectory: Trajectory, *,
                   sandbox_factory: SandboxFactory | None = None) -> Reward:
        if sandbox is None:
            raise EvalError("swe: eval needs the RUN sandbox to collect the agent's diff")
        try:
            patch, problem = await agent_diff(sandbox, task, self.scope.roots)
        except EvalError:
            raise
        except Exception as e:  # noqa: BLE001 - the RUN sandbox failed us: infrastructure
            raise EvalError(f"swe: cannot collect the agent's diff: {e!r}") from e
        details: dict[str, Any] = {"patch": patch}
        if problem:
            return Reward(value=0.0, details={**details, "reason": problem})
        if len(patch.encode()) > MAX_PATCH_BYTES:
            return Reward(value=0.0, details={**details, "patch": patch[:2000], "reason": "patch too large"})

        fresh = await self._fresh_sandbox(sandbox, sandbox_factory)
        try:
            return await self._score(task, fresh, patch, details)
        except EvalError:
            raise
        except Exception as e:  # noqa: BLE001 - the evaluator crashed: infrastructure, never reward 0
            raise EvalError(f"swe: evaluation failed: {e!r}") from e
        finally:
            try:
                await fresh.close()
            except Exception:  # noqa: BLE001 - closing is best effort; the score stands
                pass

    async def _fresh_sandbox(self, run_sandbox: HostSandbox, factory: SandboxFactory | None) -> Sandbox:
        factory = factory or self.sandbox_factory
        try:
            if factory is not None:
                return await factory()
            if self.runtime is not None and self.spec is not None:
                return await self.runtime.create(self.spec)
            spec = getattr(run_sandbox, "spec", None)
            if spec is not None:
                runtime = (getattr(run_sandbox, "runtime", None)
                           or _runtime_named(spec.runtime, self.scope.sandbox_settings))
                return await runtime.create(spec)
        except EvalError:
            raise
        except Exception as e:  # noqa: BLE001 - cannot get a sandbox: infrastructure
            raise EvalError(f"swe: cannot create the evaluation sandbox: {e}") from e
        raise EvalError("swe: eval needs a fresh sandbox: pass sandbox_factory= (to eval or SweTask) "
                        "or runtime= and spec=, or give the RUN sandbox a `spec` attribute")

    async def _score(self, task: dict, sb: Sandbox, patch: str, details: dict[str, Any]) -> Reward:
        await stage_in_sandbox(task, sb, self.scope.roots)
        await _bash_ok(sb, f"mkdir -p {EVAL_DIR}", "prepare")
        if patch.strip():
            await sb.write_file(f"{EVAL_DIR}/agent.diff", patch)
            applied = await sb.bash(f"cd {REPO} && {SAFE_GIT} apply --whitespace=nowarn {EVAL_DIR}/agent.diff 2>&1",
                                    timeout=60, **SESSION)
            if applied.exit_code != 0:
                return Reward(value=0.0, details={**details, "reason": "the agent's patch does not apply",
                                                  "log": applied.output[-2000:]})
        # the instance's tests win over whatever the agent did to those files
        reset = []
        for path in patch_paths(task["test_patch"]):
            q = _shq(path)
            reset.append(f"if {SAFE_GIT} cat-file -e HEAD:{q} 2>/dev/null; then {SAFE_GIT} checkout -q HEAD -- {q}; "
                         f"else rm -rf -- {q}; fi")
        await sb.write_file(f"{EVAL_DIR}/test.diff", task["test_patch"])
        await _bash_ok(sb, f"cd {REPO} && {' && '.join(reset) or 'true'} && "
                           f"{SAFE_GIT} apply --whitespace=nowarn {EVAL_DIR}/test.diff", "apply test_patch")

        f2p, p2p = list(task["FAIL_TO_PASS"]), list(task["PASS_TO_PASS"])
        command = task["test_command"].replace("{python}", self.python)
        ids = " ".join(_shq(t) for t in dict.fromkeys(f2p + p2p))
        timeout = float(task.get("timeout", self.timeout))
        run = await sb.bash(f"cd {REPO} && {command} {ids} > {EVAL_DIR}/test.log 2>&1; echo exit=$?", timeout=timeout, **SESSION)
        if run.timed_out:
            return Reward(value=0.0, details={**details, "reason": f"tests timed out after {timeout:g}s"})
        exit_code = checked_exit(run.output, run.exit_code,
                                 f"swe: the test command cannot run in the sandbox: {command!r}")
        try:
            log = await sb.read_file(f"{EVAL_DIR}/test.log", tail=True)  # a huge log: its end (pytest's summary)
        except Exception as e:  # noqa: BLE001 - we wrote it: its absence is ours
            raise EvalError(f"swe: the test log is missing: {e}") from e
        outcome = parse_test_log(log)
        passed = {t: outcome.get(t) in ("PASSED", "XFAIL") for t in f2p + p2p}
        ok = all(passed[t] for t in f2p) and all(passed[t] for t in p2p)
        details.update(
            exit_code=exit_code,
            fail_to_pass={t: outcome.get(t, "MISSING") for t in f2p},
            pass_to_pass_broken=[t for t in p2p if not passed[t]],
            log=log[-3000:],
        )
        return Reward(value=1.0 if ok else 0.0, details=details)


# ---------------------------------------------------------------------- helpers
def patch_paths(patch: str) -> list[str]:
    """Paths a unified git diff touches (both sides of renames)."""
    paths: list[str] = []
    for m in re.finditer(r"^diff --git a/(\S+) b/(\S+)$", patch, re.M):
        for p in m.groups():
            if p not in paths:
                paths.append(p)
    return paths


def parse_test_log(log: str) -> dict[str, str]:
    """Outcome per test id from pytest's `-rA` short summary (`PASSED tests/x.py::test_y`)."""
    return {m.group(2): m.group(1) for m in _SUMMARY.finditer(log)}


def _shq(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"


async def _bash_ok(sb: Sandbox, command: str, what: str) -> str:
    result = await sb.bash(command, timeout=120, **SESSION)
    if result.timed_out or result.exit_code != 0:
        raise EvalError(f"swe: {what} failed in the evaluation sandbox: {result.output[-1000:]}")
    return result.output


def _runtime_named(name: str, settings: Any = None) -> Any:
    from rolloutd.sandbox import get_runtime

    return get_runtime(name, settings)

