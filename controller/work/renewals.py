"""Lease renewals kept in memory: a beat extends the leases it names here, not in the database, and the expiry
pass writes a renewal down only once half of the stored lease is used.

`leases.Leases.heartbeat` renews, `queue.ItemQueue` forgets an attempt when it ends, `results.ResultIntake.expire`
persists what beats renewed and expires what they did not.

Why: a thousand daemons each naming 64 leases in a beat every few seconds rewrote ~20 deadlines per beat, an
indexed column on scattered pages: most of the database's writes (~45 pages per beat, 60–100 MB/s through the WAL
and its checkpoints at a thousand nodes). In the database a live lease still keeps at least half of its
`leaseSeconds` ahead (the pass runs every half second), as before, so a restarted controller, which starts with
no renewals, gives a beating daemon as long as it used to.
"""
from __future__ import annotations

from typing import Iterable


class Renewals:
    """attemptId → the deadline its last beat gave it (epoch seconds)."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}

    def renew(self, attempt_id: str, until: float) -> None:
        self._until[attempt_id] = until

    def until(self, attempt_id: str | None) -> float | None:
        return self._until.get(attempt_id) if attempt_id is not None else None

    def forget(self, attempt_id: str | None) -> None:
        if attempt_id is not None:
            self._until.pop(attempt_id, None)

    def prune(self, before: float) -> int:
        """Drop renewals that ran out before `before` (their attempt ended by a path that did not say so)."""
        old = [aid for aid, until in self._until.items() if until < before]
        for aid in old:
            del self._until[aid]
        return len(old)

    def __len__(self) -> int:
        return len(self._until)


def sort_out(rows: Iterable[tuple[int, str | None, float | None, float]], renewals: Renewals,
             now: float) -> tuple[list[tuple[float, int]], list[int]]:
    """Leased rows (id, attemptId, stored deadline, half of their job's lease) seen by the expiry pass → the
    deadlines to write down (a beat renewed the lease past what is stored, and half of that is used) and the
    ids whose lease ran out (no beat renewed it past now)."""
    persist: list[tuple[float, int]] = []
    dead: list[int] = []
    for item_id, attempt_id, deadline, half in rows:
        stored = deadline if deadline is not None else 0.0
        until = renewals.until(attempt_id)
        if until is not None and until > max(stored, now):
            if stored < now + half:
                persist.append((until, item_id))
        elif stored < now:
            dead.append(item_id)
    return persist, dead
