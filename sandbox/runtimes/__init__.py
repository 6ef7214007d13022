"""The sandbox runtimes, by name: a registry of module paths, each imported on first use.

Where it sits: `get_runtime(spec.runtime)` (or `create_sandbox(spec)`) is how the node daemon and the
CLI reach a runtime; its `create` (the template in `base.py`) starts the sandbox.
"""
from __future__ import annotations

import importlib

from ...crds.rolloutjob import SandboxSpec
from ...crds.settings import SandboxSettings
from ..sandbox import Sandbox
from .base import SandboxRuntime

RUNTIMES = {  # name → "module:class", relative to this package
    "bwrap": ".bwrap:BwrapRuntime",
    "apptainer": ".apptainer:ApptainerRuntime",
    "process": ".process:ProcessRuntime",
}


def runtime_class(name: str) -> type[SandboxRuntime]:
    try:
        module, cls = RUNTIMES[name].split(":")
    except KeyError:
        raise ValueError(f"unknown sandbox runtime {name!r}; choose one of {sorted(RUNTIMES)}") from None
    return getattr(importlib.import_module(module, __name__), cls)


def get_runtime(name: str, settings: SandboxSettings | None = None) -> SandboxRuntime:
    """The runtime `name`, with the node's sandbox settings (None: the defaults)."""
    return runtime_class(name)(settings)


async def create_sandbox(spec: SandboxSpec, settings: SandboxSettings | None = None) -> Sandbox:
    return await get_runtime(spec.runtime, settings).create(spec)
