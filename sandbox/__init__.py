"""Sandbox runtimes (bwrap, apptainer, process) and the in-sandbox execution server.

Where it sits: between `rolloutd.crds` and `rolloutd.agents`. The node daemon
creates a sandbox with ``await get_runtime(spec.runtime).create(spec)`` (or
`create_sandbox(spec)`) and drives it through the returned `Sandbox`
(bash / send_input / interrupt / ipython / read_file / write_file / edit_file
/ list_dir / health / close). Infrastructure failures raise a `SandboxError`
subclass; request failures raise `ExecError` (see errors.py).

Layout: sandbox.py (`Sandbox`), runtimes/ (the registry in __init__, the create
template in base.py, one module per runtime: bwrap, apptainer, process),
launch.py (the server's typed launch config), footprint.py (a sandbox's
directory, cgroup and processes on the host), limits.py (rlimits, cgroups),
protocol.py (requests and results), client.py (async UDS client), errors.py,
pool.py (`WarmPool`: sandboxes started ahead of need, one per rollout),
cli.py (`rolloutd sandbox exec`), and server/ — the execution server that runs
inside the sandbox (stdlib only; never imports the rest of rolloutd; its
procs.py is the one /proc reader, used on both sides). `SandboxSpec` is the
RolloutJob's own ``spec.sandbox`` (`rolloutd.crds.rolloutjob`).
"""
from ..crds.rolloutjob import MountSpec, SandboxLimits, SandboxSpec
from .errors import ExecError, RuntimeUnavailable, SandboxCreateError, SandboxDied, SandboxError, SandboxTimeout
from .pool import WarmPool
from .protocol import BashResult, DirEntry, FileContent, Health, IPythonResult
from .runtimes import SandboxRuntime, create_sandbox, get_runtime
from .sandbox import Sandbox

__all__ = [
    "BashResult",
    "DirEntry",
    "ExecError",
    "FileContent",
    "Health",
    "IPythonResult",
    "MountSpec",
    "RuntimeUnavailable",
    "Sandbox",
    "SandboxCreateError",
    "SandboxDied",
    "SandboxError",
    "SandboxLimits",
    "SandboxRuntime",
    "SandboxSpec",
    "SandboxTimeout",
    "WarmPool",
    "create_sandbox",
    "get_runtime",
]
