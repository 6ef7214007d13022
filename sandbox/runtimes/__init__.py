"""The sandbox runtimes, by name: registered in the `rolloutd.sandbox.runtimes` entry-point group, loaded on first use.

Where it sits: `get_runtime(spec.runtime)` (or `create_sandbox(spec)`) is how the node daemon and the
CLI reach a runtime; its `create` (the template in `base.py`) starts the sandbox. The built-ins (bwrap,
apptainer, process) and a plug-in's go the same way; the names a spec may use are `crds.rolloutjob.RuntimeKind`.
Writing one: docs/content/write-a-runtime.md.
"""
from __future__ import annotations

from importlib.metadata import EntryPoint

from ...crds.rolloutjob import SandboxSpec
from ...crds.kit import plugins
from ...crds.kit.settings import SandboxSettings
from ..sandbox import Sandbox
from .base import SandboxRuntime

ENTRY_POINT_GROUP = "rolloutd.sandbox.runtimes"


def registered() -> dict[str, EntryPoint]:
    """Every runtime of the `rolloutd.sandbox.runtimes` group, by name (the first of a name twice installed)."""
    return plugins.registered(ENTRY_POINT_GROUP)


def runtime_class(name: str) -> type[SandboxRuntime]:
    ep = plugins.entry(ENTRY_POINT_GROUP, name, "sandbox runtime")
    cls = ep.load()
    if not (isinstance(cls, type) and issubclass(cls, SandboxRuntime)):
        raise ValueError(f"sandbox runtime {name!r}: {ep.value} is not a SandboxRuntime")
    return cls


def get_runtime(name: str, settings: SandboxSettings | None = None) -> SandboxRuntime:
    """The runtime `name`, with the node's sandbox settings (None: the defaults)."""
    return runtime_class(name)(settings)


async def create_sandbox(spec: SandboxSpec, settings: SandboxSettings | None = None) -> Sandbox:
    return await get_runtime(spec.runtime, settings).create(spec)
