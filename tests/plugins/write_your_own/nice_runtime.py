"""The example of docs/content/write-a-runtime.md: a sandbox runtime in one file, registered by one entry point.

`nice-process` is the `process` runtime (no isolation: development only) whose execution server, and so every
command of the sandbox, runs 10 steps nicer than the daemon. Loaded through the registry by
tests/test_write_your_own.py, which runs a command in it.
"""
from __future__ import annotations

from dataclasses import replace

from rolloutd.crds.rolloutjob import SandboxSpec
from rolloutd.sandbox.runtimes.base import Launch
from rolloutd.sandbox.runtimes.process import ProcessRuntime

NICENESS = 10


class NiceProcessRuntime(ProcessRuntime):
    name = "nice-process"

    def launch(self, spec: SandboxSpec, layout, config, fds) -> Launch:
        plain = super().launch(spec, layout, config, fds)
        return replace(plain, argv=["nice", "-n", str(NICENESS), *plain.argv],
                       enforced={**plain.enforced, "niceness": NICENESS})
