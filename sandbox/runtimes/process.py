"""The `process` runtime: no isolation at all. For development only.

Where it sits: `get_runtime("process")`, through the create template (`base.py`); never the default. The execution
server runs as a plain child process on the host, in the sandbox's workspace
directory: commands can read and write anything the daemon can, reach the
network and see every host process. Paths inside this "sandbox" are host
paths (there is no /workspace mount); relative paths still resolve against the
workspace. It warns loudly every time a sandbox is created.

Limits: the rlimits (memory per process, file size) and, where possible, the
cgroup apply; RLIMIT_NPROC does not (without a user namespace it would count
every process of the daemon's user).
"""
from __future__ import annotations

import logging
import warnings

from ...crds.rolloutjob import SandboxSpec
from ..host.footprint import Layout
from ..launch import LaunchConfig, server_argv, server_env
from .base import Inside, Launch, SandboxRuntime

log = logging.getLogger(__name__)
WARNING = (
    "rolloutd sandbox runtime 'process' has NO ISOLATION: commands run on the host with the "
    "daemon's rights and network. Use it for development only; the default is 'bwrap'."
)


class ProcessRuntime(SandboxRuntime):
    name = "process"

    def check(self, spec: SandboxSpec) -> None:
        warnings.warn(WARNING, RuntimeWarning, stacklevel=3)
        log.warning(WARNING)

    def rlimit_nproc(self, uid: int | None) -> bool:
        return False  # without a user namespace it would count every process of the daemon's user

    def inside(self, layout: Layout) -> Inside:
        tmp = layout.root / "tmp"
        return Inside(str(layout.workspace), str(layout.ctl), str(tmp / ".rolloutd"), str(layout.root / "home"), str(tmp))

    def launch(self, spec: SandboxSpec, layout: Layout, config: LaunchConfig, fds: tuple[int, ...]) -> Launch:
        (layout.root / "tmp").mkdir()
        return Launch(argv=server_argv(config), env=server_env(layout.id), cwd=layout.workspace, enforced={"isolation": "none"})
