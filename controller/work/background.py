"""The scheduler's background pass, every EXPIRY_PASS_SECONDS: leases past their deadline requeued, backends
probed, a deleted job's results purged once kept long enough, the trajectory seq recorded, and a grace for every
lease after the controller's own stall, over the work core's parts (`core.Work`). `Scheduler.run` runs it; next
step: each duty a task of its own."""
from __future__ import annotations

import asyncio
import logging
import time

from .core import Work

log = logging.getLogger("rolloutd.scheduler")
EXPIRY_PASS_SECONDS = 0.5  # the background pass: leases past their deadline requeued, backends checked
STALL_SECONDS = 2.0        # a pass this much later than asked: the controller stalled, the nodes get a grace


async def check_health(s: Work) -> None:
    """Probe the backends; log what changed and each newly learned admission cap; wake every job's waiting leases."""
    asked = dict(s.pool.admission.reported)
    changed = await s.health.check()
    for url, ok, why in changed:
        log.warning("backend %s is %s%s", url, "healthy" if ok else "unhealthy", "" if ok else f": {why}")
    learned = {u: n for u, n in s.pool.admission.reported.items() if u not in asked}
    for url, seqs in learned.items():
        log.info("backend %s admits %d episodes at once (max_num_seqs %s)", url, s.pool.admission.cap(url),
                 seqs if seqs is not None else "not reported")
    if changed or learned:
        for job in s.jobs.names():
            s.queue.wake(job)


def _unasked(s: Work) -> bool:
    """A healthy backend whose max_num_seqs is not known yet (its admission waits for the probe)."""
    return any(s.pool.healthy(u) and u not in s.pool.admission.reported for u in s.pool.known())


def stalled(s: Work, seconds: float) -> None:
    """The controller heard nothing for `seconds` (SIGSTOP, GC, a blocked loop): every lease and node gets a whole
    lease from now to beat before anything expires (the silence was the controller's, not theirs)."""
    log.warning("the controller stalled for %.1f s: every lease gets a whole lease to be renewed", seconds)
    now = s.clock()
    s.queue.leases.grace(now, s.lease_seconds)
    s.registry.heard_all(now)


def serving(s: Work) -> None:
    """The first pass, as the server starts answering: the leases loaded at the store's opening (`held_leases.load`)
    got a whole lease from then, but a start on a loaded host can take longer than a lease before any node could
    reach the controller; every lease and node gets a whole lease from now (#37: a 2 × leaseSeconds outage was
    charged to the nodes at load 35)."""
    now = s.clock()
    s.queue.leases.grace(now, s.lease_seconds)
    s.registry.heard_all(now)


async def run(s: Work) -> None:
    last_health = 0.0
    s.pool.admission.learning = True  # from now on a new backend's episodes wait for its max_num_seqs
    serving(s)
    asked = time.monotonic()
    while not s.queue.stopped:
        late = time.monotonic() - asked - EXPIRY_PASS_SECONDS
        if late > STALL_SECONDS:  # woken this late: the whole process was stopped or its loop blocked
            stalled(s, late)
        await s.seqs.tick()  # after the check: a record waiting on a busy disk in its thread is no stall of the loop
        try:
            s.attempts.expire()
            if time.monotonic() - last_health >= s.health_interval or _unasked(s):
                last_health = time.monotonic()
                await check_health(s)
            if s.retention.due():
                await asyncio.to_thread(s.retention.sweep)
        except Exception:  # noqa: BLE001 - the loop must survive a bad pass
            log.exception("scheduler background pass failed")
        asked = time.monotonic()
        await asyncio.sleep(EXPIRY_PASS_SECONDS)
