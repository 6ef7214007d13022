"""What the `harbor` task kind reads of a tenant's Harbor task directories, always through `rolloutd.crds.kit.safe_read`.

`task_dirs` + `read_task` turn `tasks.source` into dataset rows (the controller's expansion, through
`HarborTask.load`); `stage_dir` copies a task's `tests/` or `solution/` into a sandbox (the node, at RUN and EVAL).
Every file is read beneath the job's data roots, never as root, never through a link out; an error names the
spec field and the path, never the file's content. Next step: the image build (sandbox/image/build.py) reads the
Dockerfile's build context the same way.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import re
import secrets
import shlex
import shutil
import tempfile
import tomllib
from pathlib import Path
from typing import Any, Iterator, Sequence

from rolloutd.crds.kit.safe_read import DataReadError, TreeEntry, kind, list_dir, read_text, read_tree
from rolloutd.crds.rolloutjob import MAX_MB  # a task.toml's memory: a spec's own bound

from .base import MAX_TASK_SECONDS, ConfigError, DatasetError, EvalError, json_lines, refused
from .seams import HostSandbox, Sandbox

REQUIRED = ("instruction.md", "environment/Dockerfile", "tests/test.sh")
AGENT_TIMEOUT = 600.0      # Harbor's defaults when task.toml says nothing
VERIFIER_TIMEOUT = 600.0
HARBOR_ROOT = "/.rolloutd/harbor"  # where the image's /logs, /tests, /solution point (sandbox/image/build.py)
EVAL_SESSION = {"session": "rolloutd-harbor-eval"}  # never confined: the verifier's
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_ELIDED = "'…'"


def task_dirs(source: str | Path, roots: Sequence[str] | None) -> list[tuple[str, str, str]]:
    """(task id, task directory, where it was named) for each task of `source`: a directory of task
    directories, or a JSON-lines index whose rows name one each (`path`, relative to the index)."""
    path = os.path.abspath(source)
    try:
        found = kind(path, roots)
        if found == "dir":
            names = [n for n in list_dir(path, roots) if not n.startswith(".")]
            dirs = [(n, f"{path}/{n}", f"{path}: task {n}") for n in names if kind(f"{path}/{n}", roots) == "dir"]
            if not dirs:
                raise DatasetError(f"{path}: no task directories")
            return dirs
    except DataReadError as e:
        raise refused(e) from None
    if found != "file":
        raise DatasetError(f"{path}: neither a directory of tasks nor a JSON-lines index")
    dirs = []
    for _, at, row in json_lines(path, roots):
        if not isinstance(row, dict) or not isinstance(row.get("path"), str):
            raise DatasetError(f"{at}: field 'path' (a task directory) is required")
        task_dir = posixpath.normpath(posixpath.join(posixpath.dirname(path), row["path"]))
        dirs.append((str(row.get("id") or posixpath.basename(task_dir)), task_dir, at))
    return dirs


def read_task(task_dir: str | Path, task_id: str, where: str, roots: Sequence[str] | None = None) -> dict:
    """One dataset row from a Harbor task directory; `DatasetError` names what is wrong, never file content."""
    from rolloutd.sandbox.image.dockerfile import DockerfileError, parse_dockerfile

    task_dir = str(task_dir).rstrip("/")
    try:
        for rel in REQUIRED:
            if kind(f"{task_dir}/{rel}", roots) != "file":
                raise DatasetError(f"{where}: {task_dir}/{rel} is missing (a Harbor task needs {', '.join(REQUIRED)})")
        config: dict[str, Any] = {}
        if kind(f"{task_dir}/task.toml", roots) == "file":
            text = read_text(f"{task_dir}/task.toml", roots)
            try:
                config = tomllib.loads(text)
            except RecursionError:
                raise DatasetError(f"spec.tasks.source: {where}: {task_dir}/task.toml: nests too deeply") from None
            except ValueError as e:  # TOMLDecodeError, or 4300+ digits: only where (the text may quote a key)
                at = re.search(r"\(at ([^)]*)\)", str(e))
                raise DatasetError(f"spec.tasks.source: {where}: {task_dir}/task.toml: not valid TOML"
                                   f"{f' (at {at.group(1)})' if at else ''}") from None
        dockerfile = read_text(f"{task_dir}/environment/Dockerfile", roots)
        instruction = read_text(f"{task_dir}/instruction.md", roots)
    except DataReadError as e:
        raise refused(e, where) from None
    try:
        parse_dockerfile(dockerfile, name="Dockerfile")  # out-of-subset lines fail here, at submission
    except DockerfileError as e:  # the parser quotes the line it refuses: only where and why are kept
        raise DatasetError(f"{where}: environment/{_QUOTED.sub(_ELIDED, str(e))}") from None
    section = lambda name: config.get(name) if isinstance(config.get(name), dict) else {}  # noqa: E731
    return {
        "id": task_id,
        "path": task_dir,
        "instruction": instruction,
        "agent_timeout": _positive(section("agent").get("timeout_sec", AGENT_TIMEOUT), where, "agent.timeout_sec"),
        "verifier_timeout": _positive(section("verifier").get("timeout_sec", VERIFIER_TIMEOUT), where,
                                     "verifier.timeout_sec"),
        "verifier_env": _env(section("verifier").get("env", {}), where, "verifier.env"),
        "solution_env": _env(section("solution").get("env", {}), where, "solution.env"),
        "memory_mb": _memory_mb(section("environment"), where),
        "agent_user": _user(section("agent").get("user"), where),
        "allow_internet": _flag(section("environment").get("allow_internet", True), where, "environment.allow_internet"),
        "config": config,
    }


# ---------------------------------------------------------------------- staging into a sandbox
async def stage_dir(sandbox: HostSandbox, source: str | Path, target: str, roots: Sequence[str] | None = None) -> None:
    """Copy a task's directory to `target` inside the sandbox (binary-safe: read beneath `roots`, written through
    the control directory, then copied by the sandbox's own user, so that the files are its own whatever uid it
    runs as). Never through the workspace: a process the agent left there could swap the staged tree for its own
    (a forged test.sh); the confined agent cannot write the control directory (sandbox/server/confine.py)."""
    try:
        entries = await asyncio.to_thread(read_tree, source, roots)
    except DataReadError as e:  # the job's data is at fault: it fails the job, never a reward
        raise ConfigError(str(refused(e))) from None
    name = f".rolloutd-stage-{secrets.token_hex(6)}"
    staging = Path(sandbox.root) / "ctl" / name
    await asyncio.to_thread(_write_fresh, entries, staging)
    inner = shlex.quote(f"{HARBOR_ROOT}{target}")
    try:
        await bash_ok(sandbox, f"rm -rf {inner} && cp -R --preserve=mode,timestamps /.rolloutd/{name} {inner}",
                       f"stage {target}", 60)
    finally:
        await asyncio.to_thread(shutil.rmtree, staging, True)


def _write_fresh(entries: list[TreeEntry], staging: Path) -> None:
    """Write `entries` to `staging`, readable by any uid. Prepared beside the control directory (sandboxed code
    cannot reach it there), then renamed in whole, so that no host step touches a path sandboxed code could swap."""
    private = Path(tempfile.mkdtemp(dir=staging.parent.parent))
    try:
        tree = private / "tree"
        tree.mkdir()
        dirs = [(tree, 0o755)]
        for e in entries:
            path = tree / e.rel
            if e.kind == "dir":
                path.mkdir()
                dirs.append((path, e.mode | 0o555))
            elif e.kind == "link":
                os.symlink(e.target, path)
            else:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(e.data)
                os.chmod(path, e.mode | 0o444)
        for path, mode in reversed(dirs):
            os.chmod(path, mode)
        os.rename(tree, staging)  # fails on anything but an empty directory planted at that fresh name
    finally:
        shutil.rmtree(private, ignore_errors=True)


async def bash_ok(sandbox: Sandbox, command: str, what: str, timeout: float) -> None:
    """`command` in the verifier's session; a failure or timeout is infrastructure (`EvalError`)."""
    result = await sandbox.bash(command, timeout=timeout, **EVAL_SESSION)
    if result.timed_out or result.exit_code != 0:
        raise EvalError(f"harbor: {what} failed in the sandbox: {result.output[-1000:]}")


# ---------------------------------------------------------------------- task.toml fields (never echoed back)
def _positive(value: Any, where: str, field: str, unit: str = "seconds", most: float = MAX_TASK_SECONDS) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= most:  # nan, inf too
        raise DatasetError(f"{where}: task.toml {field} must be a positive number of {unit}, at most {most:.0f}")
    return float(value)


def _memory_mb(environment: dict, where: str) -> int | None:
    """[environment] memory_mb, or the older `memory = "4G"` spelling; None when absent."""
    if "memory_mb" in environment:
        return int(_positive(environment["memory_mb"], where, "environment.memory_mb", "MB", MAX_MB))
    memory = environment.get("memory")
    if memory is None:
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([MG])i?B?\s*", str(memory), re.I)
    if not m:
        raise DatasetError(f"{where}: task.toml environment.memory must look like '2G' or '512M'")
    return int(_positive(float(m.group(1)) * (1024 if m.group(2).upper() == "G" else 1), where, "environment.memory",
                        "MB", MAX_MB))


def _flag(value: Any, where: str, field: str) -> bool:
    if not isinstance(value, bool):
        raise DatasetError(f"{where}: task.toml {field} must be true or false")
    return value


def _user(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, int)) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]*)?",
                                                               str(value)):
        raise DatasetError(f"{where}: task.toml agent.user must be a user name or uid[:group]")
    return str(value)


def _env(value: Any, where: str, field: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and re.fullmatch(r"[A-Za-z_]\w*", k)
                                              for k in value):
        raise DatasetError(f"{where}: task.toml {field} must be a table of NAME = value")
    return {k: str(v) for k, v in value.items()}


__all__ = ["bash_ok", "read_task", "stage_dir", "task_dirs"]


@contextlib.contextmanager
def snapshot(source: str | Path, roots: Sequence[str] | None) -> Iterator[Path]:
    """A private copy of a task directory's `environment/` (or the directory itself when it has none), read
    beneath `roots` (links kept as links, never followed), removed afterwards; a refused read fails the job."""
    env = Path(source) / "environment"
    try:
        entries = read_tree(env, roots) if kind(env, roots) == "dir" else read_tree(source, roots)
    except DataReadError as e:
        raise ConfigError(str(refused(e))) from None
    holder = Path(tempfile.mkdtemp(prefix="rolloutd-context-"))
    try:
        (holder / "scratch").mkdir()
        _write_fresh(entries, holder / "scratch" / "environment")
        yield holder / "scratch"
    finally:
        shutil.rmtree(holder, ignore_errors=True)
