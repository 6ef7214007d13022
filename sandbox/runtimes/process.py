"""The `process` runtime: no isolation at all. For development only.

Where it sits: `get_runtime("process")`; never the default. The execution
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
import sys
import warnings

from .base import Sandbox, SandboxRuntime, sandbox_env, server_argv
from .limits import Cgroup, rlimits_for
from .models import SandboxSpec

log = logging.getLogger(__name__)
WARNING = (
    "rolloutd sandbox runtime 'process' has NO ISOLATION: commands run on the host with the "
    "daemon's rights and network. Use it for development only; the default is 'bwrap'."
)


class ProcessRuntime(SandboxRuntime):
    name = "process"

    async def create(self, spec: SandboxSpec) -> Sandbox:
        warnings.warn(WARNING, RuntimeWarning, stacklevel=2)
        log.warning(WARNING)
        sandbox_id, root, workspace, ctl = Sandbox.layout()
        env = sandbox_env(spec, sandbox_id, HOME=str(root / "home"), TMPDIR=str(root / "tmp"))
        (root / "tmp").mkdir()
        rlimits = rlimits_for(spec, nproc=False)
        cfg = {
            "socket": str(ctl / "exec.sock"),
            "workspace": str(workspace),
            "ctl_dir": str(ctl),
            "runtime_dir": str(root / "tmp" / ".rolloutd"),
            "env": env,
            "rlimits": rlimits,
            "wall_seconds": spec.wall_seconds,
        }
        cgroup = Cgroup.create(sandbox_id, spec.memory_mb, spec.processes)
        limits = {"rlimits": rlimits, "cgroup": cgroup.kinds if cgroup else [], "isolation": "none"}
        return await Sandbox.start(
            sandbox_id=sandbox_id,
            spec=spec,
            root=root,
            argv=server_argv(sys.executable, cfg),
            cwd=workspace,
            cgroup=cgroup,
            limits=limits,
            env=env,
        )
