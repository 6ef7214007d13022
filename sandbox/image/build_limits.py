"""The bounds of an image build: each Dockerfile step's memory, processes, CPU and time, and the whole build's time.

Where it sits: `image_build.build_image` takes a `BuildLimits` (`for_build`: the node's settings, capped for a
tenant by its policy's sandbox quotas); build_step.py applies them to each step (a cgroup, RLIMIT_AS, a deadline).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rolloutd.crds.kit.settings import SandboxSettings


@dataclass(frozen=True)
class BuildLimits:
    memory_mb: int = 4096        # one step's cgroup; RLIMIT_AS is AS_FACTOR times this per process
    processes: int = 512         # one step's pids.max
    cpus: float = 2.0            # one step's CPU quota
    step_seconds: float = 1800.0
    build_seconds: float = 3600.0


AS_FACTOR = 2  # address space runs ahead of memory touched (thread stacks, arenas): the cgroup bounds what is held


def for_build(settings: SandboxSettings | None = None, quotas: Any = None) -> BuildLimits:
    """The node's build bounds (`settings`), each at most what `quotas` (a tenant policy's `TenantQuotas`; None for
    an admin's build) lets that namespace's sandboxes have."""
    s = settings or SandboxSettings()
    limits = BuildLimits(s.build_memory_mb, s.build_processes, s.build_cpus, s.build_step_seconds, s.build_seconds)
    if quotas is not None:
        limits = BuildLimits(min(limits.memory_mb, quotas.sandbox_memory_mb),
                             min(limits.processes, quotas.sandbox_processes), min(limits.cpus, quotas.sandbox_cpus),
                             min(limits.step_seconds, quotas.stage_seconds),
                             min(limits.build_seconds, quotas.stage_seconds))
    return limits


class Deadline:
    """The whole build's clock: how long the next step may run, at most the step bound and what is left."""

    def __init__(self, limits: BuildLimits) -> None:
        self.limits = limits
        self.ends = time.monotonic() + limits.build_seconds

    def step_timeout(self) -> tuple[float, str]:
        """(seconds, the setting that bounds them) for the next step."""
        left = max(0.0, self.ends - time.monotonic())
        if left < self.limits.step_seconds:
            return left, f"the build's timeout of {self.limits.build_seconds:g}s (ROLLOUTD_BUILD_SECONDS)"
        step = self.limits.step_seconds
        return step, f"the step timeout of {step:g}s (ROLLOUTD_BUILD_STEP_SECONDS)"


__all__ = ["AS_FACTOR", "BuildLimits", "Deadline", "for_build"]
