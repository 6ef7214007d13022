"""The `swe` task's repository: staged host-side as a one-commit checkout, and the agent's diff taken against it.

Called by the `swe` handler (`rolloutd.agents.tasks.swe`): INIT stages `base_commit` into the sandbox's workspace
(`stage_in_sandbox`), EVAL takes the agent's diff inside the RUN sandbox (`agent_diff`) and stages again into the
fresh sandbox, where the handler applies the diff and runs the tests.

`stage_repo` writes the tree of `base_commit` with `git archive` as a fresh repository of one commit (no history, so
the fix cannot be read from the log) with a fixed identity and date, so the same base always gives the same commit
id. A tarball `repo_path` is extracted once per file version into a cache; a tenant's repository (beneath `roots`) is
read through `rolloutd.crds.kit.safe_read` and its git runs as nobody on a root node. Git run inside a sandbox over
the agent's repository goes through `SAFE_GIT` (no hooks, no fsmonitor, no quoting of paths).
"""
from __future__ import annotations

import asyncio
import hashlib
import io
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Sequence

from rolloutd.crds.kit.safe_read import DataReadError, kind as path_kind, nobody, open_file

from .base import ConfigError, EvalError, refused
from .seams import HostSandbox, Sandbox

WORKSPACE = "/workspace"
REPO_DIR = "repo"                      # the repository lives at /workspace/repo
REPO = f"{WORKSPACE}/{REPO_DIR}"
EVAL_DIR = f"{WORKSPACE}/.rolloutd-swe"
SESSION = {"session": "rolloutd-eval"}  # EVAL's own bash session, untouched by the agent

# Host-side git: no user or system config (hooks, signing, templates), fixed identity and dates.
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "rolloutd", "GIT_AUTHOR_EMAIL": "rolloutd@localhost",
    "GIT_COMMITTER_NAME": "rolloutd", "GIT_COMMITTER_EMAIL": "rolloutd@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+00:00", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+00:00",
    "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1", "GIT_TERMINAL_PROMPT": "0",
}
# In-sandbox git over the agent's repository: nothing of its config may run code or reshape output.
SAFE_GIT = ("git -c core.hooksPath=/dev/null -c core.fsmonitor=false -c safe.directory='*' "
            "-c core.quotePath=false")

_extract_lock = threading.Lock()


def _git(cwd: Path | str, *args: str, input: bytes | None = None, tenant: bool = False) -> bytes:
    """git in `cwd`; `tenant`: over a tenant's repository, as nobody on a root node (git -C, so that even the
    chdir is nobody's; the kernel then refuses what nobody cannot read, .git/objects/info/alternates included)."""
    drop = tenant and os.geteuid() == 0
    uid, gid = nobody() if drop else (None, None)
    try:
        return subprocess.run(["git", "-c", "commit.gpgsign=false", "-c", "safe.directory=*", "-C", str(cwd), *args],
                              cwd="/", input=input, check=True, capture_output=True, env={**os.environ, **_GIT_ENV},
                              user=uid, group=gid, extra_groups=[] if drop else None).stdout
    except subprocess.CalledProcessError as e:
        raise EvalError(f"git {' '.join(args[:2])} failed in {cwd}: {e.stderr.decode(errors='replace')[-500:]}") from None


def _unpacked(repo_path: str, roots: Sequence[str] | None) -> Path:
    """A git directory for `repo_path` (beneath `roots`); a tarball is read through the safe reader and
    extracted once (per file version) into a cache, readable by any user (a tenant's git runs as nobody)."""
    try:
        found = path_kind(repo_path, roots)
        if found == "dir":
            return Path(repo_path)
        f = open_file(repo_path, roots) if found == "file" else None
    except DataReadError as e:
        raise ConfigError(str(refused(e))) from None
    if f is None or not tarfile.is_tarfile(f):
        raise EvalError(f"swe: repo_path {repo_path} is neither a directory nor a tarball")
    with f:
        st = os.fstat(f.fileno())
        key = hashlib.sha256(f"{repo_path}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}".encode()).hexdigest()[:16]
        cache = Path(tempfile.gettempdir()) / f"rolloutd-swe-{os.getuid()}"
        dest = cache / key
        with _extract_lock:
            if not dest.exists():
                cache.mkdir(parents=True, exist_ok=True)
                tmp = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=cache))
                f.seek(0)
                with tarfile.open(fileobj=f) as tar:
                    tar.extractall(tmp, filter="data")
                for dirpath, _, names in os.walk(tmp):
                    os.chmod(dirpath, 0o755)
                    for name in names:
                        if not os.path.islink(os.path.join(dirpath, name)):
                            os.chmod(os.path.join(dirpath, name), os.stat(os.path.join(dirpath, name)).st_mode | 0o444)
                try:
                    tmp.rename(dest)  # atomic: another process may have won the race, which is fine
                except OSError:
                    shutil.rmtree(tmp, ignore_errors=True)
    entries = list(dest.iterdir())
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else dest


async def stage_in_sandbox(task: dict, sandbox: HostSandbox, roots: Sequence[str] | None) -> None:
    """The repository at /workspace/repo, owned by the sandbox's user (a root node's sandboxes run as nobody)."""
    dest = Path(sandbox.workspace) / REPO_DIR
    await _to_thread(stage_repo, task["repo_path"], task["base_commit"], dest, roots)
    await _to_thread(sandbox.give, dest)


def stage_repo(repo_path: str, base_commit: str, dest: Path, roots: Sequence[str] | None = None) -> str:
    """Write the tree of `base_commit` at `dest` as a fresh one-commit repository; return its id.

    Runs on the host, into a workspace nothing untrusted has touched yet. The commit's identity and
    date are fixed, so staging the same base twice gives the same commit id.
    """
    source = _unpacked(repo_path, roots)
    archive = _git(source, "archive", "--format=tar", base_commit, tenant=roots is not None)
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise EvalError(f"swe: staging target {dest} is not empty")
    _git(dest.parent, "init", "-q", "--template=", "-b", "main", str(dest))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "--allow-empty", "-m", f"base {base_commit[:12]}")
    return _git(dest, "rev-parse", "HEAD").decode().strip()


async def agent_diff(sandbox: Sandbox, task: dict, roots: Sequence[str] | None = None) -> tuple[str, str | None]:
    """(diff, problem): the agent's changes against the staged commit, computed inside the RUN sandbox.

    Runs in a bash session of its own, so nothing the agent did to its shell (aliases, functions,
    `cd`, `set -e`) applies. `problem` says why no diff could be taken (the agent broke its repository).
    """
    out = f"{EVAL_DIR}/agent.diff"
    # the staged commit is the repository's root commit; recompute it rather than trust HEAD
    root = await _staged_commit(task, roots)
    cmd = (f"mkdir -p {EVAL_DIR} && cd {REPO} && {SAFE_GIT} add -A && "
           f"{SAFE_GIT} diff --cached --binary --no-ext-diff --no-textconv --no-color {root} > {out}")
    result = await sandbox.bash(cmd, timeout=120, **SESSION)
    if result.timed_out or result.exit_code != 0:
        # the agent broke its repository (deleted .git, ...): nothing gradable was handed in
        return "", f"cannot take the diff: {result.output[-500:]}"
    diff = await sandbox.read_file_info(out)
    if diff.truncated:
        return "", "the diff is larger than rolloutd reads from a sandbox (16 MiB)"
    return diff.content, None


_staged_cache: dict[tuple[str, str], str] = {}


async def _staged_commit(task: dict, roots: Sequence[str] | None) -> str:
    key = (task["repo_path"], task["base_commit"])
    if key not in _staged_cache:
        with tempfile.TemporaryDirectory(prefix="rolloutd-swe-stage-") as tmp:
            _staged_cache[key] = await _to_thread(stage_repo, task["repo_path"], task["base_commit"], Path(tmp) / "r",
                                                  roots)
    return _staged_cache[key]


async def _to_thread(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)
