"""The sandbox seam: `SandboxRuntime.create(spec) -> Sandbox`, and the `Sandbox` every runtime returns.

Where it sits: the node daemon (`rolloutd.agents`) calls
``get_runtime(spec.runtime).create(spec)`` (or `create_sandbox`) in its INIT
pool, drives the returned `Sandbox` from the agent loop and EVAL, and closes
it. Each runtime (one file each: `bwrap.py`, `apptainer.py`, `process.py`)
only decides *how* the execution server is started — which argv, which paths
the server sees; `Sandbox.start` does everything else the same way for all:

1. lay out a private directory ``<ROLLOUTD_SANDBOX_DIR>/<id>/`` (mode 0700)
   holding ``workspace/`` and ``ctl/`` (the server's socket and command files);
2. create the cgroup (where possible) and start the runtime's argv in a new
   process group, joined to the cgroup before exec;
3. wait for the server's ``READY`` line, connect to its 0600 Unix socket.

`Sandbox.close` is idempotent: a polite ``shutdown``, SIGKILL of the process
group it started (tracked by id: never a kill by process name), then a check
that no process carrying this sandbox's id is left (killed if one is), the
cgroup removed and the directories deleted.
"""
from __future__ import annotations

import asyncio
import atexit
import functools
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

from .client import ExecClient
from .errors import ExecError, SandboxCreateError, SandboxDied, SandboxError, SandboxTimeout
from .limits import Cgroup, candidate_parents
from .models import (
    BashRequest,
    BashResult,
    CloseSessionRequest,
    DirEntry,
    EditFileRequest,
    FileContent,
    Health,
    HealthRequest,
    InterruptRequest,
    IPythonInterruptRequest,
    IPythonRequest,
    IPythonResult,
    ListDirRequest,
    ReadFileRequest,
    SandboxSpec,
    SendInputRequest,
    ShutdownRequest,
    WriteFileRequest,
)

SERVER_PARENT = str(Path(__file__).resolve().parent)  # holds the bare `server` package
ID_VAR = "ROLLOUTD_SANDBOX_ID"  # set in every sandbox process; how leftovers are found
READY_TIMEOUT = 30.0
REPLY_MARGIN = 15.0  # infrastructure deadline = the request's own timeout + this
# the config travels as marshal (a builtin: no json/re import before bash is forked)
LAUNCHER = (
    "import sys,marshal;c=marshal.loads(bytes.fromhex(sys.argv[1]));sys.path[:0]=c['path'][:1];"
    "from server.early import fork_bash,become;become(c);b=fork_bash(c);"
    "sys.path+=c['path'][1:];from server.main import main;main(c,b)"
)
CGROUP_JOIN = (
    'while [ "$1" != -- ]; do echo $$ > "$1/cgroup.procs" || exit 125; shift; done; shift; exec "$@"'
)
DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    # UTF-8 text without LANG: with LANG every program's setlocale() opens all 12 category files
    # (an image without a locale-archive), 0.2 ms of a 1.4 ms `ls`; the other categories of
    # C.UTF-8 behave as C anyway (English messages, code-point collation)
    "LC_CTYPE": "C.UTF-8",
    "TERM": "dumb",
    "PAGER": "cat",
    "GIT_PAGER": "cat",
    "PYTHONUNBUFFERED": "1",
}

_live: dict[str, "Sandbox"] = {}  # id → open sandbox, for the exit-time safety net


def sandbox_base_dir() -> Path:
    base = Path(os.environ.get("ROLLOUTD_SANDBOX_DIR") or Path(tempfile.gettempdir()) / f"rolloutd-sandboxes-{os.getuid()}")
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    return base


def server_site_dirs() -> list[str]:
    """Where the server's one third-party import, jupyter_client (first IPython cell), lives."""
    import importlib.util

    spec = importlib.util.find_spec("jupyter_client")
    if spec is None or spec.origin is None:
        return []
    return [str(Path(spec.origin).resolve().parent.parent)]


@functools.cache
def _compile_server() -> None:
    """Byte-compile the server once, here on the host: inside the sandbox the
    tree is read-only, so a stale .pyc would be recompiled at every start."""
    import compileall

    compileall.compile_dir(str(Path(SERVER_PARENT) / "server"), quiet=2)


def server_argv(python: str, cfg: dict[str, Any]) -> list[str]:
    """The argv that starts the execution server with `cfg` (see server/main.py)."""
    import marshal

    try:
        _compile_server()
    except OSError:
        pass
    cfg = dict(cfg, path=[SERVER_PARENT, *server_site_dirs()])
    return [python, "-S", "-c", LAUNCHER, marshal.dumps(cfg).hex()]


OWNER_FILE = "owner"  # "<pid> <start time>" of the daemon that created the sandbox


def _process_identity(pid: int) -> str | None:
    """"<pid> <start time>": names one process, even after its pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    if stat[stat.rfind(b")") + 2 :].split()[0] == b"Z":
        return None
    return f"{pid} {int(stat[stat.rfind(b')') + 2 :].split()[19])}"


def sweep_stale() -> list[str]:
    """Remove what sandboxes of dead daemons left behind (a daemon killed with
    SIGKILL never runs its clean-up; its sandboxes die with it, by
    --die-with-parent, but their directories and cgroups stay): directories
    whose owner process is gone, and our empty ``rolloutd-*`` cgroups that
    have no directory any more. Returns the ids removed."""
    removed = []
    base = sandbox_base_dir()
    for entry in os.listdir(base):
        root = base / entry
        try:
            owner = (root / OWNER_FILE).read_text().strip()
        except OSError:
            # being created or removed right now, or left without an owner file:
            # stale only if old and nothing of it runs (its owner is unknown)
            try:
                if time.time() - root.stat().st_mtime < 60 or _pids_with_id(entry):
                    continue
            except OSError:
                continue
            owner = ""
        pid = owner.split()[0] if owner else ""
        if owner and pid.isdigit() and _process_identity(int(pid)) == owner:
            continue  # its daemon is alive: not ours to touch
        _reap_leftovers(entry, timeout=5.0)
        shutil.rmtree(root, ignore_errors=True)
        removed.append(entry)
    for parent in candidate_parents():
        try:
            names = [n for n in os.listdir(parent) if n.startswith("rolloutd-")]
        except OSError:
            continue
        for name in names:
            if not (base / name[len("rolloutd-") :]).exists():
                try:
                    # another daemon may be creating this sandbox right now (cgroup made, its
                    # process not in it yet): only old, empty cgroups are leftovers
                    sid = name[len("rolloutd-") :]
                    if sid not in removed and time.time() - (parent / name).stat().st_mtime < 60:
                        continue
                    (parent / name).rmdir()  # fails (and is left) while it holds processes
                except OSError:
                    pass
    return removed


@functools.cache
def _sweep_once() -> None:
    try:
        sweep_stale()
    except OSError:
        pass


def _pids_with_id(sandbox_id: str) -> list[int]:
    """Processes whose environment carries this sandbox's id (ours: same user)."""
    needle = f"{ID_VAR}={sandbox_id}".encode()
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry))
    return found


class Sandbox:
    """An open sandbox: async operations over its execution server. Created by a runtime."""

    def __init__(
        self,
        *,
        sandbox_id: str,
        spec: SandboxSpec,
        root: Path,
        workspace: Path,
        proc: asyncio.subprocess.Process,
        client: ExecClient,
        cgroup: Cgroup | None,
        limits: dict[str, Any],
        log_path: Path,
        owner: int | None = None,
    ) -> None:
        self.id = sandbox_id
        self.owner = owner  # host uid of the sandboxed code when it is not ours (a root daemon's sandbox)
        self.spec = spec
        self.root = root
        self.workspace = workspace  # host path of the writable workspace
        self.limits = limits  # what is actually enforced, e.g. {"rlimits": {...}, "cgroup": ["memory", "pids"]}
        self._proc = proc
        self._client = client
        self._cgroup = cgroup
        self._log_path = log_path
        self._closed = False
        self._died: str | None = None
        loop = asyncio.get_running_loop()
        self._watch = loop.create_task(self._watch_process())
        self._wall_timer = (
            loop.call_later(spec.wall_seconds + 5.0, self._kill_group) if spec.wall_seconds else None
        )
        _live[sandbox_id] = self

    # -- creation (shared by every runtime) --------------------------------

    @staticmethod
    def layout() -> tuple[str, Path, Path, Path]:
        """A fresh id and its private directories: (id, root, workspace, ctl)."""
        _sweep_once()
        sandbox_id = secrets.token_hex(6)
        root = sandbox_base_dir() / sandbox_id
        root.mkdir(mode=0o700)
        (root / OWNER_FILE).write_text(_process_identity(os.getpid()) or "")
        (root / "workspace").mkdir()
        (root / "ctl").mkdir(mode=0o700)
        return sandbox_id, root, root / "workspace", root / "ctl"

    @classmethod
    async def start(
        cls,
        *,
        sandbox_id: str,
        spec: SandboxSpec,
        root: Path,
        argv: list[str],
        cwd: Path | None = None,
        cgroup: Cgroup | None,
        limits: dict[str, Any],
        env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = (),
        owner: int | None = None,
    ) -> "Sandbox":
        """Start `argv` (a runtime wrapped around `server_argv`) and connect to its server."""
        log_path = root / "server.log"
        socket_path = root / "ctl" / "exec.sock"
        if cgroup is not None:
            # join the cgroup before exec through a tiny sh, not a preexec_fn: a
            # preexec_fn forces a full fork of the daemon (~10 ms) instead of vfork
            argv = ["/bin/sh", "-c", CGROUP_JOIN, "sh", *(str(d) for d in cgroup.dirs), "--", *argv]
        proc: asyncio.subprocess.Process | None = None
        spawn: asyncio.Future | None = None
        try:
            with open(log_path, "wb") as log:
                # shielded: asyncio's own clean-up of a subprocess creation cancelled
                # half-way was seen to hang (3.11); a late process is killed below
                spawn = asyncio.ensure_future(
                    asyncio.create_subprocess_exec(
                        *argv,
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=asyncio.subprocess.PIPE,
                        stderr=log,
                        cwd=str(cwd) if cwd else None,
                        env=env,
                        start_new_session=True,  # its own process group: what close() kills
                        pass_fds=pass_fds,
                    )
                )
                try:
                    proc = await asyncio.shield(spawn)
                except OSError as e:
                    raise SandboxCreateError(f"cannot start {argv[0]}: {e}") from None
            try:
                line = await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT)
            except asyncio.TimeoutError:
                line = b""
            if not line.startswith(b"READY"):
                raise SandboxCreateError(
                    f"the sandbox did not start ({' '.join(argv[:3])} ...): {_tail(log_path)}"
                )
            client = await ExecClient.connect(str(socket_path))
        except BaseException:
            # synchronous on purpose: a cancelled start (the caller's timeout, a
            # second cancel) must still leave no process, cgroup or directory
            if proc is not None and proc.returncode is None:
                _terminate(proc.pid)
            elif spawn is not None and not spawn.done():
                spawn.add_done_callback(lambda f: _kill_late_spawn(f, sandbox_id, root, cgroup))
            _reap_leftovers(sandbox_id)
            _cleanup_dirs(root, cgroup)
            raise
        return cls(
            sandbox_id=sandbox_id,
            spec=spec,
            root=root,
            workspace=root / "workspace",
            proc=proc,
            client=client,
            cgroup=cgroup,
            limits=limits,
            log_path=log_path,
            owner=owner,
        )

    # -- state --------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return not self._closed and self._died is None and self._client.closed_reason is None

    @property
    def died(self) -> str | None:
        """Why the sandbox died (None while alive or after a normal close)."""
        return self._died

    async def _watch_process(self) -> None:
        code = await self._proc.wait()
        if self._closed:
            return
        if code == 124:
            reason = f"wall time of {self.spec.wall_seconds:g}s exceeded"
        elif self._cgroup is not None and self._cgroup.oom_killed():
            reason = f"killed by the memory limit (exit {code})"
        else:
            reason = f"the sandbox process exited with status {code}: {_tail(self._log_path)}"
        self._died = reason
        self._client.mark_dead(reason)

    def _kill_group(self) -> None:
        _terminate(self._proc.pid)

    async def _call(self, request: Any, timeout: float | None) -> dict[str, Any]:
        if self._closed:
            raise SandboxDied("the sandbox is closed")
        if self._died is not None:
            raise SandboxDied(self._died)
        try:
            return await self._client.call(request, timeout)
        except SandboxDied as e:
            if self._closed:
                raise
            # the connection ends a moment before the process is reaped: wait for
            # the exit so that the reason (wall time, memory limit, crash) is known
            try:
                await asyncio.wait_for(asyncio.shield(self._watch), 2.0)
            except asyncio.TimeoutError:
                pass
            if self._died is None:
                self._died = str(e)
            raise SandboxDied(self._died) from None

    # -- bash -----------------------------------------------------------------

    async def bash(
        self, command: str, session: str = "default", timeout: float = 30.0, max_output: int = 16384
    ) -> BashResult:
        """Run `command` in the named persistent session; a non-zero exit is a normal result."""
        req = BashRequest(command=command, session=session, timeout=timeout, max_output=max_output)
        return BashResult.model_validate(await self._call(req, timeout + REPLY_MARGIN))

    async def send_input(self, text: str, session: str = "default") -> None:
        """Type `text` into the session's terminal (include "\\n" to press Enter)."""
        await self._call(SendInputRequest(text=text, session=session), REPLY_MARGIN)

    async def interrupt(self, session: str = "default") -> None:
        """Ctrl-C in the session's terminal."""
        await self._call(InterruptRequest(session=session), REPLY_MARGIN)

    async def close_session(self, session: str) -> None:
        await self._call(CloseSessionRequest(session=session), REPLY_MARGIN)

    # -- ipython --------------------------------------------------------------

    async def ipython(self, code: str, timeout: float = 30.0) -> IPythonResult:
        """Run a cell in the sandbox's persistent kernel (started on first use)."""
        # the first cell also starts the kernel (~1 s, more on a loaded node)
        req = IPythonRequest(code=code, timeout=timeout)
        return IPythonResult.model_validate(await self._call(req, timeout + 60.0 + REPLY_MARGIN))

    async def ipython_interrupt(self) -> None:
        await self._call(IPythonInterruptRequest(), REPLY_MARGIN)

    # -- files ----------------------------------------------------------------

    async def read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> str:
        """Text of `path` (relative to the workspace); lines from 1, both ends inclusive."""
        return (await self.read_file_info(path, start_line, end_line)).content

    async def read_file_info(
        self, path: str, start_line: int | None = None, end_line: int | None = None
    ) -> FileContent:
        req = ReadFileRequest(path=path, start_line=start_line, end_line=end_line)
        return FileContent.model_validate(await self._call(req, REPLY_MARGIN))

    async def write_file(self, path: str, content: str) -> None:
        await self._call(WriteFileRequest(path=path, content=content), REPLY_MARGIN)

    async def edit_file(self, path: str, old: str, new: str) -> None:
        """str_replace: raises ExecError unless `old` occurs exactly once."""
        await self._call(EditFileRequest(path=path, old=old, new=new), REPLY_MARGIN)

    async def list_dir(self, path: str = ".") -> list[DirEntry]:
        result = await self._call(ListDirRequest(path=path), REPLY_MARGIN)
        return [DirEntry.model_validate(e) for e in result["entries"]]

    def give(self, path: Path | str) -> None:
        """Hand host files the node put in the workspace (e.g. a staged repository) to the
        sandbox's user, so that sandboxed code may change them. Nothing to do unless the
        sandbox runs as another uid than the node (a root daemon's sandboxes)."""
        if self.owner is None:
            return
        top = Path(path)
        if not top.resolve().is_relative_to(self.workspace.resolve()):
            raise ValueError(f"{path} is not in the sandbox's workspace")
        os.lchown(top, self.owner, self.owner)
        for dirpath, dirnames, filenames in os.walk(top):
            for name in dirnames + filenames:
                os.lchown(os.path.join(dirpath, name), self.owner, self.owner)

    # -- lifecycle --------------------------------------------------------------

    async def health(self) -> Health:
        return Health.model_validate(await self._call(HealthRequest(), REPLY_MARGIN))

    async def close(self) -> None:
        """Kill every process of the sandbox and remove its directories. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _live.pop(self.id, None)
        if self._wall_timer is not None:
            self._wall_timer.cancel()
        try:
            if self._died is None and self._proc.returncode is None:
                try:
                    await self._client.call(ShutdownRequest(), 2.0)
                except (SandboxError, ExecError, OSError):  # a wrecked server must not stop the clean-up
                    pass
            # After a shutdown the server exits and each parent reaps its child, up
            # to our own process. Otherwise kill bottom-up: the runtime process's
            # children first (for bwrap: the pid namespace's init, which takes the
            # whole namespace with it and is reaped by bwrap), then the group.
            await _stop(self._proc, grace=1.0)
        finally:
            # even when this close is cancelled half-way: nothing may be left
            if self._proc.returncode is None:
                self._kill_group()
            self._client.close_nowait()
            release = asyncio.get_running_loop().run_in_executor(None, self._release)
            await asyncio.shield(release)  # a cancel here still lets the release finish

    def _release(self) -> None:
        _reap_leftovers(self.id)
        _cleanup_dirs(self.root, self._cgroup)

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class SandboxRuntime(ABC):
    """How sandboxes are made. One subclass per file: bwrap.py, apptainer.py, process.py."""

    name: ClassVar[str]

    @abstractmethod
    async def create(self, spec: SandboxSpec) -> Sandbox:
        """Start a sandbox for `spec`; raises SandboxCreateError (or RuntimeUnavailable)."""

    @classmethod
    def available(cls) -> str | None:
        """None when this runtime can run here, else the reason it cannot."""
        return None


def get_runtime(name: str) -> SandboxRuntime:
    from .apptainer import ApptainerRuntime
    from .bwrap import BwrapRuntime
    from .process import ProcessRuntime

    runtimes: dict[str, type[SandboxRuntime]] = {
        "bwrap": BwrapRuntime,
        "apptainer": ApptainerRuntime,
        "process": ProcessRuntime,
    }
    try:
        return runtimes[name]()
    except KeyError:
        raise ValueError(f"unknown sandbox runtime {name!r}; choose one of {sorted(runtimes)}") from None


async def create_sandbox(spec: SandboxSpec) -> Sandbox:
    return await get_runtime(spec.runtime).create(spec)


# -- helpers ------------------------------------------------------------------


def sandbox_env(spec: SandboxSpec, sandbox_id: str, **overrides: str) -> dict[str, str]:
    env = dict(DEFAULT_ENV)
    env.update(overrides)
    env.update(spec.env)
    env[ID_VAR] = sandbox_id
    return env


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode("utf-8", "replace").strip() or "(no output)"
    except OSError:
        return "(no log)"


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
    except OSError:
        pass
    return out


async def _stop(proc: asyncio.subprocess.Process, grace: float) -> None:
    """Wait `grace` s for a clean exit; then kill bottom-up, letting each parent reap."""
    for step in ("wait", "children", "group"):
        if step == "children":
            _kill_children(proc.pid)
        elif step == "group":
            _kill_pgroup(proc.pid)
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), grace if step == "wait" else 1.0)
            return
        except asyncio.TimeoutError:
            continue
    await proc.wait()


def _kill_children(pid: int) -> None:
    for child in _children(pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _kill_late_spawn(fut: asyncio.Future, sandbox_id: str, root: Path, cgroup: Cgroup | None) -> None:
    """The start was cancelled while its process was being created: kill it now."""
    if fut.cancelled() or fut.exception() is not None:
        return
    _terminate(fut.result().pid)
    _reap_leftovers(sandbox_id)
    _cleanup_dirs(root, cgroup)


def _terminate(pid: int) -> None:
    """SIGKILL a runtime process's children first (for bwrap: the pid namespace's
    init, whose death ends the namespace and which bwrap then reaps), then its group."""
    _kill_children(pid)
    _kill_pgroup(pid)


def _kill_pgroup(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap_leftovers(sandbox_id: str, timeout: float = 5.0) -> None:
    """SIGKILL any process still carrying the sandbox's id until none is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = _pids_with_id(sandbox_id)
        if not left:
            return
        if time.monotonic() > deadline:
            print(f"rolloutd.sandbox: processes of sandbox {sandbox_id} survived: {left}", file=sys.stderr)
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.002)


def _cleanup_dirs(root: Path, cgroup: Cgroup | None) -> None:
    if cgroup is not None:
        cgroup.destroy()
    shutil.rmtree(root, ignore_errors=True)


@atexit.register
def _close_all_at_exit() -> None:
    """Safety net if the daemon exits without closing: kill our process groups."""
    for sb in list(_live.values()):
        sb._kill_group()
        _reap_leftovers(sb.id, timeout=1.0)
        _cleanup_dirs(sb.root, sb._cgroup)
