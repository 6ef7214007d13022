"""A node's fair share of its job's live work: how many of the items it asks for a lease may grant it.

Called by `attempts.Attempts.lease_now` before it takes queued items (and told what it granted); reads the leases
held in memory (`held_leases`) and the queue (`queue.ItemQueue`). Next step: `attempts.py`.
"""
from __future__ import annotations

import sqlite3
from typing import Callable

from .held_leases import HeldLeases
from .queue import ItemQueue

QUEUE_SECONDS = 1.0  # a count of a job's queue, less what was granted since, is trusted this long


class NodeShares:
    """Each node's share, ⌈live ÷ the job's `executor.nodes`⌉ minus what it holds. The first daemon up must not take
    a small job whole before the others registered; with a long queue the share exceeds any node's free slots, and
    the count stops there. The leases held here are live items known without a read, and the queue's last count,
    less what was granted since, stands for QUEUE_SECONDS: at 1000 nodes × 64 slots the share needs ~63 000 live
    items, and counting them on every lease took 7.8 ms on SQLite, 29.9 on PostgreSQL (`bench share_count`)."""

    def __init__(self, queue: ItemQueue, held: HeldLeases, clock: Callable[[], float]) -> None:
        self.queue, self.held, self.clock = queue, held, clock
        self._queued: dict[str, tuple[float, int]] = {}  # job → (when its queue was counted, at least this many now)

    def share(self, db: sqlite3.Connection, node_id: str, job: str, nodes: int, asked: int) -> tuple[int, int | None]:
        """How many of the `asked` items (its free slots) node `node_id` may lease, and the job's live items if
        they were counted."""
        if nodes <= 1 or asked <= 0:
            return asked, None
        mine = self.held.held(node_id)
        enough = nodes * (asked + mine - 1) + 1  # this many live items give a share of asked + mine
        here = self.held.holding(job)
        if here >= enough:
            return asked, None
        queued = self._known(job, enough - here)
        if queued is None:
            queued = self.queue.count_queued(db, job, enough - here)
            if self.held.elsewhere is None:  # with node shards, other replicas grant from the same queue
                self._queued[job] = (self.clock(), queued)
        if here + queued >= enough:
            return asked, None
        # the queue counted whole; the leases too, unless other replicas hold some (node shards)
        live = here + queued if self.held.elsewhere is None else self.queue.count_live(db, job, enough)
        if live >= enough:
            return asked, live
        return max(0, min(asked, -(-live // nodes) - mine)), live

    def granted(self, job: str, n: int) -> None:
        """`n` of the job's queued items were leased (its queue's last count is that much shorter)."""
        known = self._queued.get(job)
        if known is not None:
            self._queued[job] = (known[0], known[1] - n)

    def _known(self, job: str, need: int) -> int | None:
        """The job's queue as last counted, when that still shows at least `need` items (else None: count it)."""
        known = self._queued.get(job)
        if known is None or self.clock() - known[0] >= QUEUE_SECONDS or known[1] < need:
            return None
        return known[1]
