"""Sandbox runtimes (bwrap, apptainer, process) and the in-sandbox execution server.

Where it sits: between `rolloutd.crds` and `rolloutd.agents`. The node daemon
creates a sandbox with ``await get_runtime(spec.runtime).create(spec)`` (or
`create_sandbox(spec)`) and drives it through the returned `Sandbox`
(bash / send_input / interrupt / ipython / read_file / write_file / edit_file
/ list_dir / health / close). Infrastructure failures raise a `SandboxError`
subclass; request failures raise `ExecError` (see errors.py).

Layout: base.py (the seam and `Sandbox`), models.py (pydantic spec, results,
wire requests), errors.py, client.py (async UDS client), limits.py (rlimits,
cgroups), one file per runtime (bwrap.py, apptainer.py, process.py), cli.py
(`rolloutd sandbox exec`), pool.py (`WarmPool`: sandboxes started ahead of
need, one per rollout), and server/ — the execution server that runs inside
the sandbox (stdlib only; never imports the rest of rolloutd).
"""
from .base import Sandbox, SandboxRuntime, create_sandbox, get_runtime
from .errors import ExecError, RuntimeUnavailable, SandboxCreateError, SandboxDied, SandboxError, SandboxTimeout
from .models import BashResult, DirEntry, FileContent, Health, IPythonResult, SandboxSpec
from .pool import WarmPool

__all__ = [
    "BashResult",
    "DirEntry",
    "ExecError",
    "FileContent",
    "Health",
    "IPythonResult",
    "RuntimeUnavailable",
    "Sandbox",
    "SandboxCreateError",
    "SandboxDied",
    "SandboxError",
    "SandboxRuntime",
    "SandboxSpec",
    "SandboxTimeout",
    "WarmPool",
    "create_sandbox",
    "get_runtime",
]
