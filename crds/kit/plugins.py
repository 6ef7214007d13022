"""Plug-ins by name: one entry-point group read into a mapping, and one refusal for a name nobody registered.

Where it sits: the registries of sandbox runtimes (`sandbox/runtimes/__init__.py`) and executors
(`controller/executors/__init__.py`) read their groups through it; each checks what it loads.
"""
from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points


def registered(group: str) -> dict[str, EntryPoint]:
    """Every entry point of `group`, by name (the first of a name twice installed)."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=group):
        found.setdefault(ep.name, ep)
    return found


def entry(group: str, name: str, noun: str) -> EntryPoint:
    """The entry point `name` of `group`; a ValueError names the `noun`s there are."""
    found = registered(group)
    if name not in found:
        raise ValueError(f"unknown {noun} {name!r}; choose one of {sorted(found)}")
    return found[name]
