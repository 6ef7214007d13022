"""The `code` task kind: write `solution.py`; EVAL runs hidden pytest tests against it in the sandbox.

Registered as entry point `code` (see `registry.get_handler`); the node daemon's INIT/RUN/EVAL pools
call `CodeTask.init` / `run` / `eval` with the rollout's sandbox (`rolloutd.sandbox`).

Rows: `{"id", "prompt", "tests"}`; `tests` is the text of a pytest file that does
`from solution import ...`. Optional `timeout` (seconds for the whole test run, at most a week).
The agent hands in its solution either as `/workspace/solution.py` (written with its tools) or, when
that file does not exist, as the last fenced code block of its answer (`base.answer_text`).

EVAL, inside the RUN sandbox (the tests are never visible to the agent before EVAL): every process the
agent left is ended first (`leftovers.py`: one could rewrite the report), then a fresh
directory `/workspace/.rolloutd-eval-<random>/` receives a copy of the solution, the tests and an
empty `pytest.ini`; `<python> -I -m pytest` runs there with plugin autoload off, `--confcutdir` and
`-c` pinned to that directory (a conftest.py or pytest.ini the agent left in the workspace is not
picked up) and a JUnit report that EVAL parses. `python` is an interpreter path valid inside the
sandbox with pytest importable: by default `sys.executable` (the bwrap runtime mounts the host root
read-only, so the daemon's venv works inside).

Reward (`reward=` option): `"fraction"` (default) = passed / total tests, `"all"` = 1 only when
every test passes. Total = max(JUnit count, `test_*` functions found statically), so a solution that
breaks collection or hides tests does not shrink the denominator. A test run past its timeout, or a
crash that leaves no report, scores 0; an interpreter that cannot be started raises `EvalError`.
"""
from __future__ import annotations

import ast
import re
import secrets
import sys
import xml.etree.ElementTree as ET
from typing import Any, ClassVar

from rolloutd.crds.trajectory import Trajectory

from .base import EvalError, Reward, TaskHandler, answer_text, check_timeout, checked_exit
from .leftovers import end_agent_processes
from .seams import Sandbox, SandboxFactory

WORKSPACE = "/workspace"
SOLUTION = f"{WORKSPACE}/solution.py"
SESSION = {"session": "rolloutd-eval"}  # EVAL's own bash session, untouched by the agent's shell

SYSTEM_PROMPT = "You are an expert Python programmer. Write correct, simple code."

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.S | re.I)


class CodeTask(TaskHandler):
    name: ClassVar[str] = "code"
    needs_sandbox: ClassVar[bool] = True
    fields: ClassVar[dict] = {"id": (str, int), "prompt": str, "tests": str}

    def __init__(self, *, reward: str = "fraction", python: str | None = None, timeout: float = 60.0,
                 system_prompt: str = SYSTEM_PROMPT) -> None:
        if reward not in ("fraction", "all"):
            raise ValueError(f"code: reward must be 'fraction' or 'all', got {reward!r}")
        self.reward = reward
        self.python = python or sys.executable
        self.timeout = timeout
        self.system_prompt = system_prompt

    def validate_row(self, row: dict, **_: Any) -> None:
        try:
            tree = ast.parse(row["tests"])
        except SyntaxError as e:
            raise ValueError(f"field 'tests' is not valid Python (line {e.lineno}: {e.msg})") from None
        if not count_tests(tree):
            raise ValueError("field 'tests' defines no test_* function")
        check_timeout(row)

    def messages(self, task: dict, tools: list[str]) -> list[dict]:
        if tools:
            how = (f"Write your solution to {SOLUTION} using the tools; you may run it to check it. "
                   "Hidden unit tests will import it as the module `solution`.")
        else:
            how = ("Reply with the complete contents of solution.py in one ```python code block. "
                   "Hidden unit tests will import it as the module `solution`.")
        return [{"role": "system", "content": self.system_prompt},
                {"role": "user", "content": f"{task['prompt'].strip()}\n\n{how}"}]

    async def eval(self, task: dict, sandbox: Sandbox | None, trajectory: Trajectory, *,
                   sandbox_factory: SandboxFactory | None = None) -> Reward:
        if sandbox is None:
            raise EvalError("code: eval needs the rollout's sandbox to run the tests in")
        try:
            return await self._eval(task, sandbox, trajectory)
        except EvalError:
            raise
        except Exception as e:  # noqa: BLE001 - the evaluator crashed: infrastructure, never reward 0
            raise EvalError(f"code: evaluation failed: {e!r}") from e

    async def _eval(self, task: dict, sandbox: Sandbox, trajectory: Trajectory) -> Reward:
        text = answer_text(trajectory)
        edir = f"{WORKSPACE}/.rolloutd-eval-{secrets.token_hex(6)}"
        details: dict[str, Any] = {"reward_mode": self.reward, "submitted": trajectory.reward_details.get("submitted")}
        details["agent_processes_ended"] = await end_agent_processes(sandbox, SESSION, "code")

        has_file = (await sandbox.bash(f"test -f {SOLUTION}", timeout=30, **SESSION)).exit_code == 0
        if has_file:
            details["source"] = SOLUTION
            copy = await sandbox.bash(f"mkdir -p {edir} && cp {SOLUTION} {edir}/solution.py", timeout=30, **SESSION)
            if copy.exit_code != 0:
                raise EvalError(f"code: cannot stage the solution: {copy.output[-500:]}")
        else:
            blocks = _FENCE.findall(text)
            if not blocks:
                return Reward(value=0.0, details={**details, "reason": "no solution.py and no code block", "passed": 0})
            details["source"] = "code block"
            await sandbox.bash(f"mkdir -p {edir}", timeout=30, **SESSION)
            await sandbox.write_file(f"{edir}/solution.py", blocks[-1])
        await sandbox.write_file(f"{edir}/test_hidden.py", task["tests"])
        await sandbox.write_file(f"{edir}/pytest.ini", "[pytest]\naddopts =\n")

        timeout = float(task.get("timeout", self.timeout))
        cmd = (f"cd {edir} && PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 {self.python} -I -m pytest -q -p no:cacheprovider "
               f"-c {edir}/pytest.ini --rootdir {edir} --confcutdir {edir} --junitxml {edir}/junit.xml "
               f"test_hidden.py > {edir}/pytest.log 2>&1; echo exit=$?")
        result = await sandbox.bash(cmd, timeout=timeout, **SESSION)
        static_total = count_tests(ast.parse(task["tests"]))
        if result.timed_out:
            return Reward(value=0.0, details={**details, "reason": f"tests timed out after {timeout:g}s",
                                              "passed": 0, "total": static_total})
        exit_code = checked_exit(result.output, result.exit_code, f"code: cannot run {self.python!r} in the sandbox")
        try:
            report = await sandbox.read_file(f"{edir}/junit.xml")
            passed, total = parse_junit(report)
        except Exception:  # noqa: BLE001 - no or broken report: the solution killed the test run
            log = await _tail(sandbox, f"{edir}/pytest.log")
            return Reward(value=0.0, details={**details, "reason": "no test report", "exit_code": exit_code,
                                              "passed": 0, "total": static_total, "log": log})
        total = max(total, static_total)
        value = (1.0 if passed == total else 0.0) if self.reward == "all" else passed / total
        details.update(passed=passed, total=total, exit_code=exit_code)
        if passed < total:
            details["log"] = await _tail(sandbox, f"{edir}/pytest.log")
        return Reward(value=value, details=details)


def count_tests(tree: ast.Module) -> int:
    """`test_*` functions at module level and in `Test*` classes (parametrisation not expanded)."""
    n = 0
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            n += 1
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            n += sum(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name.startswith("test")
                     for f in node.body)
    return n


def parse_junit(xml_text: str) -> tuple[int, int]:
    """(passed, total) from a pytest JUnit XML report; skipped tests count as not passed."""
    root = ET.fromstring(xml_text)
    cases = root.findall(".//testcase")
    passed = sum(1 for c in cases if not any(child.tag in ("failure", "error", "skipped") for child in c))
    return passed, len(cases)


async def _tail(sandbox: Sandbox, path: str, n: int = 2000) -> str:
    try:
        return (await sandbox.read_file(path, max_bytes=4 * n, tail=True))[-n:]
    except Exception:  # noqa: BLE001 - the log is a courtesy
        return ""
