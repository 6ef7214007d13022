"""The leases held right now, in memory: who holds each attempt, its stage and backend pin, and until when.

`attempts` adds a lease when it grants one and a beat reads and renews it there instead of in the database;
`queue.ItemQueue` forgets it when the attempt ends (every way out of `leased` goes through it), and the expiry
pass (`attempts.Attempts.expire`) requeues what no full beat renewed in time. A restarted controller loads
the leased items from the database and gives each a whole lease from its start.

Why: a thousand daemons each naming 64 leases in a beat every few seconds read 64 rows per beat and rewrote
~20 deadlines (an indexed column on scattered pages): a fifth of the controller's time and most of its writes.
The stages a beat reports are kept here too: written, they were three row updates per rollout, each in a commit
of its own; the database keeps the stage of the grant.
"""
from __future__ import annotations

import contextlib
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator


@dataclass(slots=True)
class HeldLease:
    item: int
    job: str
    node_id: str
    stage: str
    backend: str | None
    holds_backend: bool
    until: float  # epoch seconds: back to the queue after this unless a full beat renews it
    version: Any = None  # the policy version the lease carried (None also after a controller restart)
    since: float = 0.0  # epoch seconds: when it entered its stage (the grant, a beat's change, a restart)
    beat: float = 0.0   # epoch seconds: the last beat that named it (the grant until one does)
    stall_counted: bool = False  # counted once in `stalls` for its current stage
    turn: int | None = None  # the turn of a rollout in RUN, when its node says (beat-turns)


STALL_SECONDS = 300.0  # a lease in one stage (or unheard) this long is stalled, unless the settings say otherwise


def unheard(leases: Iterable[HeldLease], now: float, most: int = 8) -> str:
    """For a log line: how long no beat named these leases, by node (a silent node, or beats that came late)."""
    return ", ".join(sorted({f"{live.node_id} unheard {now - live.beat:.1f} s" for live in leases})[:most])


class HeldLeases:
    """attemptId → `HeldLease`, for every item in state `leased`; with them, by second, when each runs out (the expiry
    pass reads only the seconds past, not every lease: 64 000 at 1000 nodes took ~10 ms of the loop every half
    second), by job how many are in each stage (a job's progress counts them here; beats do not write stages
    to the database) and by node which it holds (its fair share; no index on the items' node)."""

    def __init__(self, clock: Callable[[], float] = time.time, stall_seconds: float | None = None) -> None:
        self.clock = clock
        self.by_attempt: dict[str, HeldLease] = {}
        self._due: dict[int, set[str]] = {}            # int(until) → attempts
        self._stages: dict[str, Counter[str]] = {}     # job → stage → leases
        self._by_node: dict[str, set[str]] = {}        # node → its attempts (node shards hand a node's over whole)
        self._by_job: dict[str, set[str]] = {}         # job → its attempts (the in-flight view reads one job's)
        # in one stage this long: stalled (`inflight.py`; ROLLOUTD_STALLED_AFTER_SECONDS)
        self.stall_seconds = STALL_SECONDS if stall_seconds is None else stall_seconds
        self.stalls = 0                                # leases in one stage, or unheard, stall_seconds or more
        self.elsewhere: Callable[[str], dict[str, int]] | None = None  # node shards: other replicas' stages
        self._answering: Counter[str] = Counter()      # node → its beats waiting for the disk (`answering`)

    def add(self, attempt_id: str, live: HeldLease) -> None:
        self.forget(attempt_id)
        self.by_attempt[attempt_id] = live
        self._due.setdefault(int(live.until), set()).add(attempt_id)
        self._stages.setdefault(live.job, Counter())[live.stage] += 1
        self._by_node.setdefault(live.node_id, set()).add(attempt_id)
        self._by_job.setdefault(live.job, set()).add(attempt_id)

    def get(self, attempt_id: str) -> HeldLease | None:
        return self.by_attempt.get(attempt_id)

    def forget(self, attempt_id: str | None) -> None:
        live = self.by_attempt.pop(attempt_id, None) if attempt_id is not None else None
        if live is None:
            return
        self._undue(attempt_id, live.until)
        self._count_stall(live, self.clock())
        attempts = self._by_job.get(live.job)
        if attempts is not None:
            attempts.discard(attempt_id)
            if not attempts:
                del self._by_job[live.job]
        mine = self._by_node.get(live.node_id)
        if mine is not None:
            mine.discard(attempt_id)
            if not mine:
                del self._by_node[live.node_id]
        counter = self._stages[live.job]
        counter[live.stage] -= 1
        if counter[live.stage] <= 0:
            del counter[live.stage]
            if not counter:
                del self._stages[live.job]

    def heard(self, live: HeldLease, stage: str, now: float) -> None:
        """A beat named the lease in `stage`."""
        live.beat = now
        if stage != live.stage:
            self.set_stage(live, stage, now)

    def set_turns(self, node_id: str, turns: dict[str, int]) -> None:
        """A beat of node `node_id` named these rollouts' turns (beat-turns); those not its leases are ignored."""
        for aid, turn in turns.items():
            if (live := self.by_attempt.get(aid)) is not None and live.node_id == node_id:
                live.turn = turn

    def set_stage(self, live: HeldLease, stage: str, now: float) -> None:
        self._count_stall(live, now)
        live.since, live.stall_counted = now, False
        counter = self._stages[live.job]
        counter[live.stage] -= 1
        if counter[live.stage] <= 0:
            del counter[live.stage]
        counter[stage] += 1
        live.stage = stage

    def renew(self, attempt_id: str, live: HeldLease, until: float) -> None:
        if int(until) != int(live.until):
            self._undue(attempt_id, live.until)
            self._due.setdefault(int(until), set()).add(attempt_id)
        live.until = until

    def expired(self, now: float) -> list[tuple[str, HeldLease]]:
        """The leases past their `until` (still held: the caller forgets or requeues them), but a node's whose beat
        is being answered (`answering`)."""
        out = []
        for second in [s for s in self._due if s <= now]:
            for aid in self._due[second]:
                live = self.by_attempt[aid]
                if live.until < now and live.node_id not in self._answering:
                    out.append((aid, live))
        return out

    @contextlib.contextmanager
    def answering(self, node_id: str, lease_seconds: float) -> Iterator[None]:
        """A beat of `node_id`, committed, waits for its results to be on the disk before it is answered (an fsync:
        seconds on a busy disk), and the node beats again only once answered: none of its leases expires meanwhile,
        and each runs at least a whole lease from the answer (those the beat renewed, and those granted on its
        reply)."""
        self._answering[node_id] += 1
        try:
            yield
        finally:
            self._answering[node_id] -= 1
            if self._answering[node_id] <= 0:
                del self._answering[node_id]
            until = self.clock() + lease_seconds
            for aid in list(self._by_node.get(node_id, ())):
                if (live := self.by_attempt.get(aid)) is not None and live.until < until:
                    self.renew(aid, live, until)

    def grace(self, now: float, lease_seconds: Callable[[str], float]) -> None:
        """The controller itself stalled (stopped, paused, its loop blocked): it heard no beat meanwhile, so every
        lease gets at least a whole lease from now to be renewed in, as after a restart (`load`)."""
        for aid, live in list(self.by_attempt.items()):
            self.renew(aid, live, max(live.until, now + lease_seconds(live.job)))

    def attempts_of(self, job: str) -> list[str]:
        """The attempts of the job's leases held now."""
        return list(self._by_job.get(job, ()))

    def count_stalls(self, now: float) -> int:
        """Count the leases in one stage, or unnamed by a beat, `stall_seconds` or more now (once per stage; `forget`
        and `set_stage` count those that left a stage after that long): the metrics read this at each scrape."""
        for live in self.by_attempt.values():
            self._count_stall(live, now)
        return self.stalls

    def _count_stall(self, live: HeldLease, now: float) -> None:
        if not live.stall_counted and live.since and max(now - live.since, now - live.beat) >= self.stall_seconds:
            live.stall_counted = True
            self.stalls += 1

    def held(self, node_id: str) -> int:
        """The leases node `node_id` holds."""
        return len(self._by_node.get(node_id, ()))

    def holding(self, job: str) -> int:
        """The job's leases held here (with node shards, other replicas hold more)."""
        return len(self._by_job.get(job, ()))

    def attempts_on(self, node_id: str) -> list[str]:
        """The attempts node `node_id` holds here."""
        return list(self._by_node.get(node_id, ()))

    def stages(self, job: str) -> dict[str, int]:
        """Stage → the job's leases in it now (with node shards, `elsewhere`: those other replicas hold too)."""
        out = dict(self._stages.get(job, ()))
        for stage, n in (self.elsewhere(job) if self.elsewhere is not None else {}).items():
            out[stage] = out.get(stage, 0) + n
        return out

    def _undue(self, attempt_id: str, until: float) -> None:
        bucket = self._due.get(int(until))
        if bucket is not None:
            bucket.discard(attempt_id)
            if not bucket:
                del self._due[int(until)]

    def load(self, db: sqlite3.Connection, now: float, lease_seconds: Callable[[str], float]) -> int:
        """The leased items of the database (a restart): each keeps its stored deadline, and at least a whole
        lease from now (daemons that kept beating while the controller was away must not lose their work)."""
        rows = db.execute("SELECT id, job, node_id, attempt_id, stage, backend, holds_backend, deadline FROM items "
                          "WHERE state = 'leased'").fetchall()
        for item, job, node_id, aid, stage, backend, holds, deadline in rows:
            if aid is None or node_id is None:
                continue
            self.add(aid, HeldLease(item, job, node_id, stage or "leased", backend, bool(holds),
                               max(deadline or 0.0, now + lease_seconds(job)), since=now, beat=now))
        return len(rows)

    def readopt(self, db: Any, node_id: str, attempt_ids: list[str], until: float,
                take: Callable[[str, str], None]) -> list[str]:
        """Attempts a beat of `node_id` named that are not held here: those the database says the node holds (a
        grant another replica's memory had, its node served here now: `..shards`) are held from now (`take`: their
        backend slot counted); the others are returned (cancelled, expired, or not the node's)."""
        marks = ",".join("?" * len(attempt_ids))
        rows = db.execute(f"SELECT attempt_id, id, job, stage, backend, holds_backend FROM items WHERE attempt_id IN "
                          f"({marks}) AND state = 'leased' AND node_id = ?", (*attempt_ids, node_id)).fetchall()
        for aid, item, job, stage, backend, holds in rows:
            if holds and backend:
                take(backend, job)
            self.add(aid, HeldLease(item, job, node_id, stage or "leased", backend, bool(holds), until,
                                    since=self.clock(), beat=self.clock()))
        found = {r[0] for r in rows}
        return [aid for aid in attempt_ids if aid not in found]

    def __len__(self) -> int:
        return len(self.by_attempt)
