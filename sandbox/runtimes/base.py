"""The create template: every runtime starts a sandbox through the same sequence, filling small hooks.

Where it sits: `runtimes.get_runtime(name).create(spec)` runs `SandboxRuntime.create`; a runtime module
(bwrap.py, apptainer.py, process.py) fills the hooks; the started server is driven through `sandbox.Sandbox`.
"""
from __future__ import annotations

import asyncio
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ...crds.rolloutjob import SandboxSpec
from ...crds.kit.settings import SandboxSettings
from ..client import ExecClient
from ..errors import RuntimeUnavailable, SandboxCreateError
from ..host.footprint import Layout, reap_leftovers, remove
from ..launch import ID_VAR, LaunchConfig
from ..host.limits import CGROUP_JOIN, CPU_SKIPPED, Cgroup, bound_workspace, rlimits_for
from ..host.netns import Outbound
from ..sandbox import Sandbox, log_tail, terminate

READY_TIMEOUT = 30.0
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


@dataclass(frozen=True)
class Inside:
    """Where the server's places are, as the sandbox sees them."""

    workspace: str
    ctl: str
    runtime_dir: str
    home: str
    tmp: str


CONTAINED = Inside("/workspace", "/.rolloutd", "/tmp/.rolloutd", "/tmp/home", "/tmp")  # bwrap, apptainer


@dataclass(frozen=True)
class Identity:
    """Who sandboxed code is: the host `uid`/`gid` a root runtime's server drops to (None: the daemon's own),
    and its HOME inside (None: `Inside.home`)."""

    uid: int | None = None
    gid: int | None = None
    home: str | None = None


@dataclass
class Launch:
    """The runtime's command line around the server's, and how to start it."""

    argv: list[str]
    env: dict[str, str] | None = None  # None: the daemon's environment
    cwd: Path | None = None
    pass_fds: tuple[int, ...] = ()
    enforced: dict[str, Any] = field(default_factory=dict)  # added to `Sandbox.limits`
    outbound: Outbound | None = None  # network: true (netns.py): attached once the runtime has started


class SandboxRuntime(ABC):
    """How sandboxes are made: `create` is the sequence; subclasses fill the hooks below it."""

    name: ClassVar[str]

    def __init__(self, settings: SandboxSettings | None = None) -> None:
        """`settings`: the node's (where sandboxes are made, who sandboxed code runs as; None: the defaults)."""
        self.settings = settings or SandboxSettings()

    async def create(self, spec: SandboxSpec) -> Sandbox:
        """Start a sandbox for `spec`; raises SandboxCreateError (or RuntimeUnavailable).

        1. check the runtime and the spec (hooks `available`, `check`; `open_fds` for what the runtime passes);
        2. lay out a private directory ``<ROLLOUTD_SANDBOX_DIR>/<id>/`` (`footprint.Layout`) holding
           ``workspace/`` and ``ctl/`` (the server's socket and command files);
        3. fill the server's `launch.LaunchConfig` (paths as the sandbox sees them: hook `inside`) and let
           the runtime wrap the server's command line in its own (hook `launch`);
        4. create the cgroup (where possible) and start that command in a new process group, joined to
           the cgroup before exec; wait for the server's ``READY`` line and connect to its 0600 socket.
        """
        reason = self.available()
        if reason:
            raise RuntimeUnavailable(reason)
        self.check(spec)
        fds = self.open_fds()
        try:
            return await self._start(spec, fds)
        finally:
            for fd in fds:
                os.close(fd)

    async def _start(self, spec: SandboxSpec, fds: tuple[int, ...]) -> Sandbox:
        who = self.identity(spec)
        uid = who.uid
        layout = Layout.new(self.settings.sandbox_dir)
        inside = self.inside(layout)
        env = sandbox_env(spec, layout.id, HOME=who.home or inside.home, TMPDIR=inside.tmp)
        rlimits = rlimits_for(spec.limits, nproc=self.rlimit_nproc(uid))
        config = LaunchConfig(
            socket=f"{inside.ctl}/exec.sock", workspace=inside.workspace, ctl_dir=inside.ctl,
            runtime_dir=inside.runtime_dir, env=env, rlimits=rlimits, wall_seconds=spec.limits.wall_seconds, uid=uid,
            gid=who.gid,
        )
        bounds = bound_workspace(layout.workspace, spec.limits.workspace_mb)
        try:
            launch = self.launch(spec, layout, config, fds)
        except (SandboxCreateError, OSError) as e:
            remove(layout.root, None)
            if isinstance(e, OSError):
                raise SandboxCreateError(f"cannot prepare the sandbox directory: {e}") from None
            raise
        cgroup = Cgroup.create(layout.id, spec.limits.memory_mb, spec.limits.processes, spec.limits.cpus)
        limits = {"rlimits": rlimits, "cgroup": cgroup.kinds if cgroup else [], **bounds, **launch.enforced}
        if spec.limits.cpus and "cpu" not in limits["cgroup"]:
            limits["cpu_skipped"] = CPU_SKIPPED
        return await start(layout, spec, launch, cgroup, limits, owner=uid, owner_gid=who.gid)

    # -- hooks -------------------------------------------------------------------

    @classmethod
    def available(cls) -> str | None:
        """None when this runtime can run here, else the reason it cannot."""
        return None

    def check(self, spec: SandboxSpec) -> None:
        """Refuse a spec this runtime cannot honour (SandboxCreateError), before anything is made."""

    def open_fds(self) -> tuple[int, ...]:
        """Descriptors the runtime's process inherits (closed here once it has started)."""
        return ()

    def identity(self, spec: SandboxSpec) -> Identity:
        """Who sandboxed code runs as (SandboxCreateError for a `spec.user` it cannot be)."""
        if spec.user is not None:
            raise SandboxCreateError(f"sandbox.user is for the bwrap runtime with a root filesystem image, not {self.name}")
        return Identity()

    def rlimit_nproc(self, uid: int | None) -> bool:
        """Whether RLIMIT_NPROC may be set: only where the sandbox's user is its own (a user namespace)."""
        return True

    def inside(self, layout: Layout) -> Inside:
        return CONTAINED

    @abstractmethod
    def launch(self, spec: SandboxSpec, layout: Layout, config: LaunchConfig, fds: tuple[int, ...]) -> Launch:
        """The runtime's command line around the server's (`launch.server_argv(config)`)."""


def sandbox_env(spec: SandboxSpec, sandbox_id: str, **overrides: str) -> dict[str, str]:
    env = dict(DEFAULT_ENV)
    env.update(overrides)
    env.update(spec.env)
    env[ID_VAR] = sandbox_id
    return env


async def start(layout: Layout, spec: SandboxSpec, launch: Launch, cgroup: Cgroup | None,
                limits: dict[str, Any], owner: int | None, owner_gid: int | None = None) -> Sandbox:
    """Start the runtime's command and connect to its server; nothing is left if this fails or is cancelled."""
    log_path = layout.root / "server.log"
    argv = launch.argv
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
                    cwd=str(launch.cwd) if launch.cwd else None,
                    env=launch.env,
                    start_new_session=True,  # its own process group: what close() kills
                    pass_fds=launch.pass_fds,
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
            raise SandboxCreateError(f"the sandbox did not start ({' '.join(argv[:3])} ...): {log_tail(log_path)}")
        if launch.outbound is not None:  # after READY: bwrap has set up the namespace's loopback (no race on lo)
            await launch.outbound.attach()
        client = await ExecClient.connect(str(layout.ctl / "exec.sock"))
    except BaseException:
        # synchronous on purpose: a cancelled start (the caller's timeout, a
        # second cancel) must still leave no process, cgroup or directory
        if launch.outbound is not None:
            launch.outbound.close()
        if proc is not None and proc.returncode is None:
            terminate(proc.pid)
        elif spawn is not None and not spawn.done():
            spawn.add_done_callback(lambda f: _kill_late_spawn(f, layout, cgroup))
        reap_leftovers(layout.id)
        remove(layout.root, cgroup)
        raise
    return Sandbox(sandbox_id=layout.id, spec=spec, root=layout.root, workspace=layout.workspace, proc=proc,
                   client=client, cgroup=cgroup, limits=limits, log_path=log_path, owner=owner,
                   owner_gid=owner_gid, outbound=launch.outbound)


def _kill_late_spawn(fut: asyncio.Future, layout: Layout, cgroup: Cgroup | None) -> None:
    """The start was cancelled while its process was being created: kill it now."""
    if fut.cancelled() or fut.exception() is not None:
        return
    terminate(fut.result().pid)
    reap_leftovers(layout.id)
    remove(layout.root, cgroup)
