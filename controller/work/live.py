"""The leases held right now, in memory: who holds each attempt, its stage and backend pin, and until when.

`leases` adds a lease when it grants one and a beat reads and renews it there instead of in the database;
`queue.ItemQueue` forgets it when the attempt ends (every way out of `leased` goes through it), and the expiry
pass (`results.ResultIntake.expire`) requeues what no full beat renewed in time. A restarted controller loads
the leased items from the database and gives each a whole lease from its start.

Why: a thousand daemons each naming 64 leases in a beat every few seconds read 64 rows per beat and rewrote
~20 deadlines (an indexed column on scattered pages): a fifth of the controller's time and most of its writes.
"""
from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Callable


@dataclass(slots=True)
class Live:
    item: int
    job: str
    node_id: str
    stage: str
    backend: str | None
    holds_backend: bool
    until: float  # epoch seconds: back to the queue after this unless a full beat renews it


class LiveLeases:
    """attemptId → `Live`, for every item in state `leased`."""

    def __init__(self) -> None:
        self.by_attempt: dict[str, Live] = {}

    def add(self, attempt_id: str, live: Live) -> None:
        self.by_attempt[attempt_id] = live

    def get(self, attempt_id: str) -> Live | None:
        return self.by_attempt.get(attempt_id)

    def forget(self, attempt_id: str | None) -> None:
        if attempt_id is not None:
            self.by_attempt.pop(attempt_id, None)

    def expired(self, now: float) -> list[tuple[str, Live]]:
        return [(aid, live) for aid, live in self.by_attempt.items() if live.until < now]

    def load(self, db: sqlite3.Connection, now: float, lease_seconds: Callable[[str], float]) -> int:
        """The leased items of the database (a restart): each keeps its stored deadline, and at least a whole
        lease from now (daemons that kept beating while the controller was away must not lose their work)."""
        rows = db.execute("SELECT id, job, node_id, attempt_id, stage, backend, holds_backend, deadline FROM items "
                          "WHERE state = 'leased'").fetchall()
        for item, job, node_id, aid, stage, backend, holds, deadline in rows:
            if aid is None or node_id is None:
                continue
            self.by_attempt[aid] = Live(item, job, node_id, stage or "leased", backend, bool(holds),
                                        max(deadline or 0.0, now + lease_seconds(job)))
        return len(rows)

    def __len__(self) -> int:
        return len(self.by_attempt)
