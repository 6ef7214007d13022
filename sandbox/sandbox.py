"""An open sandbox: `Sandbox`, the object every runtime returns, and its closing.

Where it sits: created by the create template (`runtimes/base.py`) once the execution server is
up; the node daemon (`rolloutd.agents`) drives it (bash / ipython / files) from its INIT, RUN and
EVAL pools through `client.ExecClient`, and closes it: a polite ``shutdown``, SIGKILL of the
process group it started (tracked by id: never a kill by process name), then a check that no
process carrying this sandbox's id is left (`footprint.reap_leftovers`), the cgroup removed and
the directories deleted.
"""
from __future__ import annotations

import asyncio
import atexit
import os
import signal
from pathlib import Path
from typing import Any

from ..crds.rolloutjob import SandboxSpec
from .client import ExecClient
from .errors import ExecError, SandboxDied, SandboxError
from .host.footprint import reap_leftovers, remove
from .host.limits import Cgroup
from .protocol import (
    BashRequest,
    BashResult,
    CloseSessionRequest,
    ConfineRequest,
    Confinement,
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
    SendInputRequest,
    ShutdownRequest,
    WriteFileRequest,
)
from .server.procs import children, identity

REPLY_MARGIN = 15.0  # infrastructure deadline = the request's own timeout + this
# What one read_file brings to the node by default: sandboxed code decides how large its files are, and the
# node daemon holds every reply of up to 64 rollouts at once (a 1 GB file would have been read whole).
READ_LIMIT = 16 << 20

_live: dict[str, "Sandbox"] = {}  # id → open sandbox, for the exit-time safety net


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
        owner_gid: int | None = None,
        outbound: Any = None,
    ) -> None:
        self.id = sandbox_id
        self.owner = owner  # host uid of the sandboxed code when it is not ours (a root daemon's sandbox)
        self.owner_gid = owner if owner_gid is None else owner_gid
        self.spec = spec
        self.root = root
        self.workspace = workspace  # host path of the writable workspace
        self.limits = limits  # what is actually enforced, e.g. {"rlimits": {...}, "cgroup": ["memory", "pids"]}
        self._proc = proc
        self._client = client
        self._cgroup = cgroup
        self._outbound = outbound  # network: true: its slirp4netns (netns.Outbound)
        self._log_path = log_path
        self._closed = False
        self._died: str | None = None
        loop = asyncio.get_running_loop()
        self._watch = loop.create_task(self._watch_process())
        self._wall_timer = (
            loop.call_later(spec.limits.wall_seconds + 5.0, self._kill_group) if spec.limits.wall_seconds else None
        )
        _live[sandbox_id] = self

    # -- state --------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return not self._closed and self._died is None and self._client.closed_reason is None

    def gone(self) -> bool:
        """Dead, by a cheap check (a /proc read and a poll(), no round trip): closed, its runtime
        process ended or is a zombie, or the server has hung up its end of the connection."""
        if not self.alive or self._proc.returncode is not None or identity(self._proc.pid) is None:
            return True
        try:
            return self._client.hung_up()
        except (AttributeError, OSError, ValueError):
            return True

    @property
    def exited(self) -> asyncio.Task:
        """Done when the sandbox's runtime process has exited."""
        return self._watch

    @property
    def died(self) -> str | None:
        """Why the sandbox died (None while alive or after a normal close)."""
        return self._died

    async def _watch_process(self) -> None:
        code = await self._proc.wait()
        if self._closed:
            return
        if code == 124:
            reason = f"wall time of {self.spec.limits.wall_seconds:g}s exceeded"
        elif self._cgroup is not None and self._cgroup.oom_killed():
            reason = f"killed by the memory limit (exit {code})"
        else:
            reason = f"the sandbox process exited with status {code}: {log_tail(self._log_path)}"
        self._died = reason
        self._client.mark_dead(reason)

    def _kill_group(self) -> None:
        terminate(self._proc.pid)

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

    async def confine(self, exempt: list[str]) -> Confinement:
        """From now on the sandbox's sessions (but `exempt`) and kernel write only outside the control
        directory and cannot signal or trace other processes (Landlock; `confined` False where the kernel
        lacks it). The sessions running now end: their next command starts a confined one."""
        return Confinement.model_validate(await self._call(ConfineRequest(exempt=exempt), REPLY_MARGIN))

    # -- ipython --------------------------------------------------------------

    async def ipython(self, code: str, timeout: float = 30.0) -> IPythonResult:
        """Run a cell in the sandbox's persistent kernel (started on first use)."""
        # the first cell also starts the kernel (~1 s, more on a loaded node)
        req = IPythonRequest(code=code, timeout=timeout)
        return IPythonResult.model_validate(await self._call(req, timeout + 60.0 + REPLY_MARGIN))

    async def ipython_interrupt(self) -> None:
        await self._call(IPythonInterruptRequest(), REPLY_MARGIN)

    # -- files ----------------------------------------------------------------

    async def read_file(self, path: str, start_line: int | None = None, end_line: int | None = None, *,
                        max_bytes: int = READ_LIMIT, tail: bool = False) -> str:
        """Text of `path` (relative to the workspace); lines from 1, both ends inclusive. At most `max_bytes`
        of the file are read: its first ones, or with `tail` its last ones (a log's end)."""
        return (await self.read_file_info(path, start_line, end_line, max_bytes=max_bytes, tail=tail)).content

    async def read_file_info(self, path: str, start_line: int | None = None, end_line: int | None = None, *,
                             max_bytes: int = READ_LIMIT, tail: bool = False) -> FileContent:
        req = ReadFileRequest(path=path, start_line=start_line, end_line=end_line, max_bytes=max_bytes, tail=tail)
        return FileContent.model_validate(await self._call(req, REPLY_MARGIN))

    async def write_file(self, path: str, content: str) -> None:
        await self._bounded(WriteFileRequest(path=path, content=content))

    async def edit_file(self, path: str, old: str, new: str) -> None:
        """str_replace: raises ExecError unless `old` occurs exactly once."""
        await self._bounded(EditFileRequest(path=path, old=old, new=new))

    async def _bounded(self, request: Any) -> None:
        """A write; a full workspace says which bound it met."""
        try:
            await self._call(request, REPLY_MARGIN)
        except ExecError as e:
            size = self.limits.get("workspace_mb")
            if size and "No space left on device" in str(e):
                raise ExecError(f"{e} (the workspace holds at most {size} MB: spec.sandbox.limits.workspaceMB)") from None
            raise

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
        os.lchown(top, self.owner, self.owner_gid)
        for dirpath, dirnames, filenames in os.walk(top):
            for name in dirnames + filenames:
                os.lchown(os.path.join(dirpath, name), self.owner, self.owner_gid)

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
        if self._outbound is not None:
            self._outbound.close()
        reap_leftovers(self.id)
        remove(self.root, self._cgroup)

    async def __aenter__(self) -> "Sandbox":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def log_tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode("utf-8", "replace").strip() or "(no output)"
    except OSError:
        return "(no log)"


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
    for child in children(pid):
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


def terminate(pid: int) -> None:
    """SIGKILL a runtime process's children first (for bwrap: the pid namespace's
    init, whose death ends the namespace and which bwrap then reaps), then its group."""
    _kill_children(pid)
    _kill_pgroup(pid)


def _kill_pgroup(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@atexit.register
def _close_all_at_exit() -> None:
    """Safety net if the daemon exits without closing: kill our process groups."""
    for sb in list(_live.values()):
        sb._kill_group()
        reap_leftovers(sb.id, timeout=1.0)
        remove(sb.root, sb._cgroup)
