"""Typed sandbox exceptions, all in one place.

Where it sits: raised by `rolloutd.sandbox` (runtimes, `Sandbox`, the client)
and caught by the node daemon (`rolloutd.agents`). The split matters for RL:

* `SandboxError` and its subclasses (`SandboxCreateError`, `SandboxDied`,
  `SandboxTimeout`) mean the *rollout machinery* failed. The caller must retry
  or exclude the rollout, never score it as reward 0.
* `ExecError` (deliberately *not* a `SandboxError`) means the *request* failed
  (no such file, an ambiguous edit, a bad session name): a normal tool result
  to show the agent. ``except SandboxError`` therefore catches exactly the
  infrastructure failures.

A command that exits non-zero or runs past its timeout is neither: it is a
normal `BashResult` (``exit_code``, ``timed_out``).
"""
from __future__ import annotations

from rolloutd.crds.errors import AgentError, InfraError


class SandboxError(InfraError):
    """Base class of every sandbox failure."""


class SandboxCreateError(SandboxError):
    """The sandbox could not be created (runtime missing, bad image, start-up failed)."""


class SandboxDied(SandboxError):
    """The sandbox (its execution server) is gone: killed, crashed, past its wall time."""


class SandboxTimeout(SandboxError):
    """The execution server did not answer in time (infrastructure, not a command timeout)."""


class RuntimeUnavailable(SandboxCreateError):
    """The runtime cannot run on this machine (e.g. no apptainer binary)."""


class ExecError(AgentError):
    """The request failed for a reason the caller controls (e.g. file not found)."""
