"""The example of docs/content/write-an-executor.md: an executor in one file, registered by one entry point.

`nice-local` is the `local` executor (node daemons as subprocesses of the controller) whose daemons, and so the
rollouts they run, are 10 steps nicer than the controller. Loaded through the registry by
tests/test_write_your_own.py, which starts a daemon with it and stops it.
"""
from __future__ import annotations

from rolloutd.controller.executors.local import LocalExecutor

NICENESS = 10


class NiceLocalExecutor(LocalExecutor):
    kind = "nice-local"

    def command(self, slot: int) -> list[str]:
        return ["nice", "-n", str(NICENESS), *super().command(slot)]
