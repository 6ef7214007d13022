"""The registry of task kinds: `get_handler(kind)` finds a `TaskHandler` through the `rolloutd.tasks` entry points.

Called by the node daemon's job set-up (`rolloutd.agents.daemon.jobconfig`) and the controller's apply checks and
expansion (`rolloutd.controller.spec_checks`, `rolloutd.controller.work.expansion`); the handler it returns (the seam,
`rolloutd.agents.tasks.base`) then loads the rows and runs INIT/RUN/EVAL. The built-ins (math, stem, code, swe,
harbor, registered in pyproject.toml) and third-party plug-ins are found the same way.
"""
from __future__ import annotations

import os
import re
import sys
from importlib.metadata import entry_points
from typing import Any

from rolloutd.crds.errors import ConfigurationError

from .base import TaskHandler

ENTRY_POINT_GROUP = "rolloutd.tasks"


class UnknownTaskKind(ConfigurationError, LookupError):
    """No handler is registered under the requested kind."""


_scanned: tuple[tuple, dict[str, list[Any]]] | None = None  # (what the scan depended on, what it found)


def _path_key() -> tuple:
    """What the entry-point set depends on: sys.path and each of its directories' mtime (installing, removing or
    re-installing a distribution adds or replaces a *.dist-info directory there, which changes the mtime)."""
    key = []
    for p in sys.path:
        try:
            key.append((p, os.stat(p or ".").st_mtime_ns))
        except OSError:
            key.append((p, None))
    return tuple(key)


def _entry_points() -> dict[str, list[Any]]:
    """The registered task kinds, rescanned only when `_path_key` changed: a scan reads every distribution's
    metadata (4 ms idle, tens of ms on a loaded host), and the controller looks handlers up on its event loop at
    every job create (issue 36: ~4.8 s of the loop in one stall run)."""
    global _scanned
    key = _path_key()
    if _scanned is not None and _scanned[0] == key:
        return _scanned[1]
    found: dict[str, list[Any]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        same = found.setdefault(ep.name, [])
        if all(ep.value != other.value for other in same):
            same.append(ep)
    _scanned = (key, found)
    return found


def known_kinds() -> list[str]:
    """Every task kind registered in the `rolloutd.tasks` entry-point group."""
    return sorted(_entry_points())


def handler_options(options: dict[str, Any]) -> dict[str, Any]:
    """A job's `spec.tasks.options` as the handler's keyword arguments (`requireBoxed` → `require_boxed`)."""
    return {re.sub(r"(?<!^)(?=[A-Z])", "_", k).lower(): v for k, v in options.items()}


def get_handler(kind: str, **options: Any) -> TaskHandler:
    """The handler registered as `kind`, instantiated with `options` (e.g. `reward="all"`).

    The entry point may name a `TaskHandler` subclass, a factory returning one, or an instance
    (then `options` must be empty).
    """
    registered = _entry_points()
    if kind not in registered:
        raise UnknownTaskKind(
            f"unknown task kind {kind!r}; known kinds: {', '.join(sorted(registered)) or '(none)'} "
            f"(plug-ins register in the {ENTRY_POINT_GROUP!r} entry-point group)"
        )
    candidates = registered[kind]
    if len(candidates) > 1:
        raise UnknownTaskKind(
            f"task kind {kind!r} is registered more than once: {', '.join(ep.value for ep in candidates)}"
        )
    ep = candidates[0]
    try:
        target = ep.load()
    except Exception as e:  # noqa: BLE001 - a broken plug-in must say which one
        raise UnknownTaskKind(f"task kind {kind!r}: cannot load {ep.value}: {e}") from e
    if isinstance(target, TaskHandler):
        if options:
            raise TypeError(f"task kind {kind!r} is a ready-made instance; it takes no options")
        return target
    if not callable(target):
        raise UnknownTaskKind(f"task kind {kind!r}: {ep.value} is neither a TaskHandler nor a factory")
    handler = target(**options)
    if not isinstance(handler, TaskHandler):
        raise UnknownTaskKind(f"task kind {kind!r}: {ep.value} returned {type(handler).__name__}, not a TaskHandler")
    return handler


__all__ = ["ENTRY_POINT_GROUP", "UnknownTaskKind", "get_handler", "handler_options", "known_kinds"]
