"""The executors, by kind: registered in the `rolloutd.controller.executors` entry-point group, loaded on first use.

Where it sits: the controller's wiring (`server.py`) makes the enabled kinds with `make(kinds, site)`; each is a
class with the `Executor` interface (`base.py`: ensure / observe / release / shutdown / logs) and a
`from_site(site)` that builds it from what the controller offers (`base.Site`). The built-ins (`local.py`,
`slurm/`, `kubernetes/`) and a plug-in's go the same way; the kinds a spec may name are
`crds.executor.ExecutorKind`. Writing one: docs/content/write-an-executor.md.
"""
from __future__ import annotations

from importlib.metadata import EntryPoint
from typing import Iterable

from rolloutd.crds.kit import plugins

from .base import Executor, Site

ENTRY_POINT_GROUP = "rolloutd.controller.executors"


def registered() -> dict[str, EntryPoint]:
    """Every executor of the `rolloutd.controller.executors` group, by kind (the first of a kind twice installed)."""
    return plugins.registered(ENTRY_POINT_GROUP)


def executor_class(kind: str) -> type:
    """The class registered as `kind`; a ValueError names the kinds there are."""
    ep = plugins.entry(ENTRY_POINT_GROUP, kind, "executor")
    cls = ep.load()
    if not (isinstance(cls, type) and callable(getattr(cls, "from_site", None))):
        raise ValueError(f"executor {kind!r}: {ep.value} is not a class with from_site(site)")
    return cls


def make(kinds: Iterable[str], site: Site) -> dict[str, Executor]:
    """One executor of each kind, in order, built from `site`."""
    return {kind: executor_class(kind).from_site(site) for kind in kinds}
