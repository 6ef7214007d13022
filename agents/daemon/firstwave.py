"""Pacing a job's first wave on a node: lease no more of it than the warm pool has sandboxes ready for.

`pipeline.Pipeline.room` (what `lease.Leaser` asks the controller for) is capped by `FirstWave.cap` while the
pool warms for the first wave (`JobConfig.first_wave`, `WarmPool.expect`); the pool's `on_created` (the pipeline's)
calls `sandbox_ready`, which wakes the lease loop while the wave is paced. Next: a node joining a running job goes
the same way (registration → pool → lease), so it is paced too; a DAPO refill's bursts are served by the pool's
own `Demand`.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from rolloutd.sandbox import WarmPool

from .rollouts import Phase, Rollouts

# Pacing's backstop: a pool that neither warms nor fails (a creation hung in the kernel) must not keep a node from
# leasing. 64 cold starts take 2-4 s of a loaded 2-core node: 30 s is far past any healthy first wave and well
# under initSeconds' default (120 s), which a cold INIT would have to fit in anyway.
PACE_SECONDS = 30.0


class FirstWave:
    """While the warm pool warms for the first wave, the node leases only as many rollouts as the pool has idle
    sandboxes not yet promised: promised are the leased rollouts (phase LEASED or INIT) that have not got their
    sandbox yet.

    Why: a cold start is CPU-bound (~30 ms of CPU against ~2 ms for a bare bwrap): N cold starts at once share
    the cores and every one of them finishes late (64 on 2 cores: p95 3.5-4.3× N bare bwraps). Paced, each INIT
    gets a warm sandbox, the first rollouts start within tens of ms and RUN starts in lease order. The rollouts
    this node does not lease yet stay queued in the controller, where other nodes can take them.

    The pacing ends for good (`cap` None: the normal room from then on) once the first wave's `width` has been
    leased, the pool records a creation failure (`acquire` then creates cold and raises that error as before:
    a broken runtime never stalls the node, every rollout comes back as an infra failure), the pool is closed,
    or `PACE_SECONDS` after the first `cap` (a timer wakes the lease loop then)."""

    def __init__(self, pool: WarmPool, width: int, rollouts: Rollouts, wake: Callable[[], None]) -> None:
        self.pool, self.width, self.rollouts, self.wake = pool, width, rollouts, wake
        self._leased0 = rollouts.stats["leased"]
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.over = False

    def sandbox_ready(self) -> None:
        """A sandbox went idle (or a creation failed): while pacing, the lease loop re-checks its room."""
        if not self.over:
            self.wake()

    def cap(self) -> int | None:
        """The most leases the first wave may take now (None: no pacing any more)."""
        if self.over or self._ended():
            return None
        promised = sum(1 for r in self.rollouts.live.values()
                       if r.phase in (Phase.LEASED, Phase.INIT) and r.sandbox is None and not r.closing)
        return max(0, self.pool.idle - promised)

    def _ended(self) -> bool:
        if self._deadline is None:   # leasing has begun: the bound of time runs from here
            self._deadline = time.monotonic() + PACE_SECONDS
            self._timer = asyncio.get_running_loop().call_later(PACE_SECONDS, self.wake)
        if (self.rollouts.stats["leased"] - self._leased0 < self.width and not self.pool.stats["failures"]
                and not self.pool.closed and time.monotonic() < self._deadline):
            return False
        self.over = True
        if self._timer is not None:
            self._timer.cancel()
        return True
