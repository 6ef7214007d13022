"""The `TaskHandler` seam: one dataset kind = one handler (load, prompt, INIT, RUN, EVAL).

Sits between the node daemon's INIT/RUN/EVAL pools (`rolloutd.agents`, the callers) and the
sandbox (`rolloutd.sandbox`) and agent loop (`rolloutd.agents.loop.run`) it drives. Handlers are looked
up by `rolloutd.agents.tasks.registry.get_handler(kind)` through the `rolloutd.tasks` entry-point group, so the
built-ins (math, stem, code, swe, registered in pyproject.toml) and third-party plug-ins go the same way.

How the agent's answer reaches EVAL: `run` stores it in `trajectory.reward_details` under
`"submitted"` (what the agent handed in via a submit tool, or None) and `"final_text"` (the text of
its last assistant message). `answer_text(trajectory)` reads it back (submitted first, then
final_text, then the last assistant message in `trajectory.messages`), so EVAL also works on a
trajectory produced by some other caller of the agent loop. Every `Reward.details` repeats the
extracted answer, so the pipeline may overwrite `reward_details` with it without losing anything.

Every read of the tenant's data goes through `rolloutd.crds.kit.safe_read` (beneath the job's data roots, never as
root, never through a link out); `refused` turns its refusal into a `DatasetError`.

Errors: `DatasetError` (a bad dataset row: names the file, line and field, never the row's content), `EvalError` (the
evaluator itself failed: an infrastructure failure, never reward 0), `ConfigError` (the job's
configuration cannot work: fails the job, never a reward); a kind nobody registered is the registry's
`UnknownTaskKind`.
"""
from __future__ import annotations

import json
import math
import re
from abc import ABC
from dataclasses import dataclass
from pathlib import Path
from numbers import Real
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from pydantic import BaseModel, Field

from rolloutd.crds.kit.safe_read import DataReadError, kind as path_kind, open_file
from rolloutd.crds.kit.documents import unreadable
from rolloutd.crds.errors import ConfigurationError, InfraError
from rolloutd.crds.trajectory import Trajectory

from .seams import LLM, AgentConfig, RolloutContext, Sandbox, SandboxFactory, Tokenizer

if TYPE_CHECKING:
    from rolloutd.crds.kit.settings import SandboxSettings
    from rolloutd.crds.tenancy import TenantQuotas


class Reward(BaseModel):
    """What EVAL returns: the scalar reward and a JSON-able account of how it was reached."""

    value: float
    details: dict[str, Any] = Field(default_factory=dict)


class DatasetError(ConfigurationError, ValueError):
    """A dataset file or row is malformed. The message names the file, the line and the field."""


def json_lines(path: str | Path, roots: Sequence[str] | None = None):
    """Yield `(line number, "file:line", value)` for each non-blank line of a JSON-lines file, read through
    `rolloutd.crds.kit.safe_read` beneath `roots` (None: an admin's job); a line that is not JSON or UTF-8 raises
    `DatasetError` naming `file:line`, never its content. Read lazily."""
    try:
        f = open_file(path, roots)
    except DataReadError as e:
        raise refused(e) from None
    with f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                value = json.loads(raw.decode("utf-8"), parse_float=_finite, parse_constant=_not_a_number)
            except UnicodeDecodeError:
                raise DatasetError(f"{where}: not UTF-8 text") from None
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            except (ValueError, RecursionError) as e:  # 4300+ digits, a number JSON has not (NaN, 1e400), nesting
                raise DatasetError(f"{where}: {unreadable(e)}") from None
            yield lineno, where, value


def _finite(text: str) -> float:
    """A row's number: what a double holds (Python parses 1e400 to inf, which no JSON can carry on)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:30]} is beyond a double")
    return value


def _not_a_number(name: str) -> float:
    """Python's json takes NaN, Infinity and -Infinity; JSON has none, and the lease that carries a row is JSON."""
    raise ValueError(f"{name} is not a JSON number")


MAX_TASK_SECONDS = 7 * 86400  # a task's own timeouts (a row's, a task.toml's): finite and at most a week


def check_timeout(row: dict) -> None:
    """A row's optional `timeout` (seconds for its test run, code and swe): a positive number, at most a week (a
    string failed EVAL as infra at every attempt; 0 or less scored 0 as "timed out")."""
    value = row.get("timeout")
    if "timeout" in row and (isinstance(value, bool) or not isinstance(value, (int, float))
                             or not 0 < value <= MAX_TASK_SECONDS):
        raise ValueError(f"field 'timeout' must be a positive number of seconds, at most {MAX_TASK_SECONDS}")


def refused(e: DataReadError, where: str = "") -> "DatasetError":
    """The reader's refusal as a `DatasetError`: the spec field, where in the dataset, the path and why."""
    return DatasetError(f"{e.field}: {where + ': ' if where else ''}{e.path}: {e.why}")


class EvalError(InfraError, RuntimeError):
    """The evaluator itself failed (sandbox died, test harness crashed, repository unusable), or
    staging the task in INIT did (e.g. `swe` cannot check out its repository).

    An infrastructure failure: the pipeline marks the rollout `infra` and retries or excludes it;
    it is never turned into reward 0.
    """


class ConfigError(ConfigurationError, ValueError):
    """The job's configuration cannot work for this task (a handler rejecting its settings, a file
    the spec names missing). Raised from INIT or RUN: never a reward, the controller fails the job.
    The message starts with the spec field at fault (`spec.tasks.source: ...`)."""


@dataclass(frozen=True)
class HandlerScope:
    """Where a job runs on a node, which its handler is given once (`TaskHandler.bind`).

    - `roots`: the job's data roots (its tenant policy's `data_roots`; None for an admin's job): what a handler reads
      of the tenant's data after `load` (harbor's tests/ and solution/, swe's repository) goes through
      `rolloutd.crds.kit.safe_read` beneath them.
    - `sandbox_settings`: the node's sandbox settings (image cache, build size, egress allow-list; None: defaults).
    - `quotas`: the job's tenant policy quotas (None for an admin's job), which cap a tenant's image builds.
    """

    roots: tuple[str, ...] | None = None
    sandbox_settings: SandboxSettings | None = None
    quotas: TenantQuotas | None = None


class TaskHandler(ABC):
    """Base of every task kind. Subclasses set `name`, `fields` and override what differs.

    - `fields`: required row fields and their accepted types, checked by `load`.
    - `validate_row(row)`: extra per-row checks; raise `ValueError("field 'x': ...")`.
    - `messages(task, tools)`: the initial chat (system + user).
    - `init(task, sandbox)`: stage task files into the sandbox workspace (default: nothing). The sandbox and the
      LLM a handler gets are typed by `seams.Sandbox` and `seams.LLM` (None when the job has none).
    - `run(...)`: the agent loop; the default suits every built-in.
    - `eval(task, sandbox, trajectory, *, sandbox_factory=None)`: the `Reward` (abstract in spirit: the default
      raises). `eval_sandbox`: True when EVAL scores in a fresh sandbox (swe: the tests must not see what the
      agent left behind). The node daemon then starts one as RUN ends and passes `sandbox_factory=`
      (`seams.SandboxFactory`) to `eval`; it closes it if EVAL does not. Without `eval_sandbox` it passes none.
    - `scope` (`HandlerScope`): where the job runs on this node, given once by the node daemon (`bind`) before
      the first task: its data roots, the node's sandbox settings, its tenant's quotas. `load` takes its own roots.
    - `agent_kinds`: the `agent.kind`s this handler runs (the API refuses a job asking another, 422 at apply).
    - `sandbox_spec`: None, or `async sandbox_spec(task, base) -> SandboxSpec` when each task brings
      its own sandbox (harbor: the task's image); INIT then creates that one instead of taking a
      sandbox of the job's spec from the warm pool (which the daemon then leaves empty).
    """

    name: ClassVar[str] = ""
    scope: HandlerScope = HandlerScope()  # where the job runs on this node (`bind`; until then an admin's job's)
    agent_kinds: ClassVar[tuple[str, ...]] = ("loop",)
    needs_sandbox: ClassVar[bool] = True
    eval_sandbox: ClassVar[bool] = False
    sandbox_spec: ClassVar[Any] = None
    fields: ClassVar[dict[str, type | tuple[type, ...]]] = {}
    id_field: ClassVar[str] = "id"

    def bind(self, scope: HandlerScope) -> None:
        """The node daemon's one call before the job's first task: where the job runs (`HandlerScope`)."""
        self.scope = scope

    # ------------------------------------------------------------------ dataset
    def load(self, source: str | Path, limit: int | None = None, *, roots: Sequence[str] | None = None) -> list[dict]:
        """Read up to `limit` rows of a JSON-lines file, each validated for this kind.

        `roots`: the job's data roots (its policy's `data_roots`; None for an admin's job): the file is read
        beneath them through `rolloutd.crds.kit.safe_read`, never as root. Blank lines are skipped. Any problem
        raises `DatasetError` naming `file:line` and field, never the file's content.
        """
        path = Path(source)
        try:
            found = path_kind(path, roots)
        except DataReadError as e:
            raise refused(e) from None
        if found != "file":
            why = {None: "dataset file not found", "dir": "is a directory, not a dataset file"}.get(
                found, "is not a regular file (a FIFO, socket or device)")
            raise DatasetError(f"{path}: {why}")
        rows: list[dict] = []
        seen: dict[str, int] = {}
        if limit is not None and limit <= 0:
            return rows
        for lineno, where, row in json_lines(path, roots):
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
            for field, types in self.fields.items():
                if field not in row:
                    raise DatasetError(f"{where}: missing field '{field}' (a {self.name} row needs {sorted(self.fields)})")
                if not isinstance(row[field], types) or isinstance(row[field], bool):
                    raise DatasetError(
                        f"{where}: field '{field}' must be {_type_names(types)}, got {type(row[field]).__name__}"
                    )
            try:
                self.validate_row(row, base_dir=path.parent)
            except (ValueError, TypeError) as e:
                raise DatasetError(f"{where}: {e}") from None
            key = str(row[self.id_field])
            if key in seen:
                raise DatasetError(f"{where}: field '{self.id_field}': duplicate id (first on line {seen[key]})")
            seen[key] = lineno
            rows.append(row)
            if limit is not None and len(rows) >= limit:
                break  # read no further: a bad line past the limit is not the job's problem
        return rows

    def validate_row(self, row: dict, *, base_dir: Path) -> None:
        """Kind-specific checks beyond field presence and type; may normalise the row in place."""

    def task_id(self, task: dict) -> str:
        return str(task[self.id_field])

    # ------------------------------------------------------------------ rollout
    def messages(self, task: dict, tools: list[str]) -> list[dict]:
        raise NotImplementedError(f"task kind {self.name!r} does not build messages")

    async def init(self, task: dict, sandbox: Sandbox | None) -> None:
        """Stage task files into the sandbox workspace. Nothing by default."""

    async def run(self, task: dict, sandbox: Sandbox | None, llm: LLM | None, *, tokenizer: Tokenizer | None,
                  config: AgentConfig, ctx: RolloutContext) -> Trajectory:
        """Run the agent loop on `messages(task, config.tools)` and stash the answer for EVAL."""
        from rolloutd.agents.loop.run import run_agent_loop  # the loop imports nothing from here
        from rolloutd.agents.loop.rollout import with_system

        kind = config.agent_kind
        if kind != "loop":  # the API refuses such a job (`agent_kinds`): a plug-in's own override may get here
            raise NotImplementedError(f"task kind {self.name!r} runs agent.kind loop only, not {kind!r}")
        result = await run_agent_loop(
            with_system(self.messages(task, list(config.tools)), config.system_prompt),
            sandbox=sandbox, llm=llm, tokenizer=tokenizer, config=config, ctx=ctx,
        )
        return stash_answer(result.trajectory, submitted=result.submitted, final_text=result.final_text)

    async def eval(self, task: dict, sandbox: Sandbox | None, trajectory: Trajectory, *,
                   sandbox_factory: SandboxFactory | None = None) -> Reward:
        """The reward. `sandbox_factory`: passed only when `eval_sandbox` is True (a handler without it may leave
        the keyword out of its override)."""
        raise NotImplementedError(f"task kind {self.name!r} does not evaluate")


def as_reward(result: Reward | Real) -> Reward:
    """What a handler's `eval` returned, as a `Reward`: a `Reward`, or a bare real number (its value, no
    details). Anything else is the evaluator's failure (`EvalError`), never a reward."""
    if isinstance(result, Reward):
        return result
    if isinstance(result, Real) and not isinstance(result, bool):
        return Reward(value=float(result))
    raise EvalError(f"EVAL returned {type(result).__name__}, not a Reward")


# ---------------------------------------------------------------------- the answer seam
def checked_exit(output: str, fallback: int, cannot_run: str) -> int:
    """The exit status a test command printed as `exit=N` (else the shell's own); 126/127 — the command
    could not be started in the sandbox — raise `EvalError` with `cannot_run` and the status, never reward 0."""
    m = re.search(r"exit=(\d+)", output)
    exit_code = int(m.group(1)) if m else fallback
    if exit_code in (126, 127):
        raise EvalError(f"{cannot_run} (exit {exit_code})")
    return exit_code


def stash_answer(trajectory: Trajectory, *, submitted: str | None, final_text: str | None) -> Trajectory:
    """Record the agent's answer where EVAL finds it (see the module docstring)."""
    details = dict(trajectory.reward_details)
    details["submitted"] = submitted
    details["final_text"] = final_text or ""
    trajectory.reward_details = details
    return trajectory


def answer_text(trajectory: Trajectory) -> str:
    """The agent's answer: the submitted text, else its final text, else its last assistant message."""
    details = trajectory.reward_details
    if details.get("submitted"):
        return str(details["submitted"])
    if details.get("final_text"):
        return str(details["final_text"])
    for message in reversed(trajectory.messages):
        if message.get("role") == "assistant":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):  # content parts
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def _type_names(types: type | tuple[type, ...]) -> str:
    types = types if isinstance(types, tuple) else (types,)
    names = {str: "a string", int: "a number", float: "a number", list: "a list", dict: "an object"}
    return " or ".join(dict.fromkeys(names.get(t, t.__name__) for t in types))


__all__ = [
    "DatasetError", "EvalError", "Reward", "TaskHandler", "answer_text", "as_reward", "stash_answer",
]
