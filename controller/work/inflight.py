"""What a job has in flight right now: one row per leased rollout, from the leases held in memory (no SQL).

Served by `http/inflight.py` (`GET …/rolloutjobs/{name}/inflight`) and printed by `rolloutctl inflight`.
A rollout is **stalled** when it has been in its stage (queued on its node, init, run, eval) for `stalled_after`
seconds or more, or no beat of its node has named it for that long: a tool call that never returns, a sandbox
that never starts, a node that went silent before its lease ran out. The stage comes from the node's beats
(`held_leases.HeldLease`); `queued` is a lease its node has not started yet.
The turn of a rollout in RUN is the model calls it started, as its node's beats say (feature beat-turns).
The rows are bounded (`limit`, stalled first, then the longest in their stage): one pass over the job's own leases,
CHUNK at a time between yields to the event loop, keeping the best `limit`. Next step: a live trace link per row (tracing on).
"""
from __future__ import annotations

import asyncio
import heapq
from datetime import datetime, timezone
from typing import Any

from .held_leases import HeldLease, HeldLeases

STAGE_NAMES = {"leased": "queued", "init": "init", "run": "run", "eval": "eval"}
DEFAULT_LIMIT = 500
MAX_LIMIT = 5000
CHUNK = 2000  # leases keyed between two yields to the event loop


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _attempt(attempt_id: str) -> int | None:
    """The attempt number an attempt id carries (`{item}.{attempt}.{random}`, `attempts.py`)."""
    parts = attempt_id.split(".")
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


def stalled(live: HeldLease, now: float, stalled_after: float) -> bool:
    return now - live.since >= stalled_after or now - live.beat >= stalled_after


def row(attempt_id: str, live: HeldLease, now: float, stalled_after: float) -> dict[str, Any]:
    return {"attemptId": attempt_id, "item": live.item, "attempt": _attempt(attempt_id),
            "stage": STAGE_NAMES.get(live.stage, live.stage),
            "turn": live.turn if live.stage == "run" else None,
            "inStageSeconds": round(max(now - live.since, 0.0), 3), "stageSince": _iso(live.since),
            "lastHeartbeat": _iso(live.beat), "sinceHeartbeatSeconds": round(max(now - live.beat, 0.0), 3),
            "node": live.node_id, "backend": live.backend, "policyVersion": live.version,
            "stalled": stalled(live, now, stalled_after)}


async def inflight(leases: HeldLeases, job: str, now: float, stalled_after: float, limit: int = DEFAULT_LIMIT
                   ) -> dict[str, Any]:
    """The job's in-flight rollouts: counts by stage, how many are stalled, and at most `limit` rows. On the event
    loop, yielding to it after every CHUNK leases (the leases that end meanwhile are left out)."""
    attempts = leases.attempts_of(job)
    stages = {name: 0 for name in STAGE_NAMES.values()}
    for stage, n in leases.stages(job).items():
        stages[STAGE_NAMES.get(stage, stage)] = n
    cutoff = now - stalled_after
    best: list[tuple[bool, float, str]] = []
    n_stalled = 0
    for start in range(0, len(attempts), CHUNK):
        # stalled first (in its stage since the cutoff, or unheard since), then the longest in its stage
        keyed = [(live.since > cutoff and live.beat > cutoff, live.since, aid)
                 for aid in attempts[start:start + CHUNK] if (live := leases.get(aid)) is not None]
        n_stalled += sum(1 for fresh, _since, _aid in keyed if not fresh)
        best = heapq.nsmallest(limit, best + keyed)
        if start + CHUNK < len(attempts):
            await asyncio.sleep(0)
    shown = [(aid, live) for _fresh, _since, aid in best if (live := leases.get(aid)) is not None]
    return {"total": len(attempts), "stalled": n_stalled, "stages": stages, "stalledAfterSeconds": stalled_after,
            "truncated": len(attempts) > len(shown), "items": [row(aid, live, now, stalled_after) for aid, live in shown]}
