"""A policy update's timeline: seconds from the announce to each of its steps, and to each daemon's first report.

Marked by `policy_versions.PolicyVersions.announce` (drain) and `_live` (keep, abort) as the update goes; its `out`
is the announce's answer's `steps`, which the trainer gets back and `bench` breaks down.
"""
from __future__ import annotations

import time
from typing import Any


class Steps:
    """An update's timeline for its answer (`steps`): seconds from the announce to each step, and to each daemon's
    first report of a kind (`held`, `fenced`: node → seconds), for the bench's breakdown."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self._steps: dict[str, float] = {}
        self._nodes: dict[str, dict[str, float]] = {}

    def mark(self, step: str) -> None:
        self._steps[step] = time.monotonic()

    def nodes(self, step: str) -> dict[str, float]:
        return self._nodes.setdefault(step, {})

    @property
    def out(self) -> dict[str, Any]:
        since = lambda t: round(t - self.t0, 4)  # noqa: E731
        return {**{k: since(t) for k, t in self._steps.items()},
                **{k: {n: since(t) for n, t in v.items()} for k, v in self._nodes.items()}}
