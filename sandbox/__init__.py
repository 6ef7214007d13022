"""Sandboxes: runtimes (bwrap, apptainer, process) behind one seam, and the in-sandbox execution server.

Where it sits: between `rolloutd.crds` and `rolloutd.agents`. The node daemon calls
``await get_runtime(spec.runtime).create(spec)`` (or `create_sandbox(spec)`, or a `WarmPool`) and
drives the returned `Sandbox`; infrastructure failures raise a `SandboxError`, request failures
`ExecError` (errors.py). The modules and their roles: README.md, "Layout".
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
