"""A node's fair share of its job's live work: how many of the items it asks for a lease may grant it.

Called by `attempts.Attempts.lease_now` before it takes queued items; reads the leases held in memory
(`held_leases`) and the queue (`queue.ItemQueue`). Next step: `attempts.py`.
"""
from __future__ import annotations

import sqlite3

from .held_leases import HeldLeases
from .queue import ItemQueue


def fair_share(queue: ItemQueue, held: HeldLeases, db: sqlite3.Connection, node_id: str, job_name: str, nodes: int,
               asked: int) -> tuple[int, int | None]:
    """How many of the `asked` items (its free slots) node `node_id` may lease, and the job's live items if they
    were counted: its share of the job's live work, ⌈live ÷ `nodes`⌉ (the job's `executor.nodes`), minus what it
    holds. The first daemon up must not take a small job whole before the others registered; with a long queue
    the share exceeds any node's free slots, and the count stops there. The leases held here are live items known
    without a read: at 1000 nodes × 64 slots the share needs ~63 000 of them, and counting that many on every
    lease took 7.8 ms on SQLite, 29.9 on PostgreSQL (`python -m bench share_count`)."""
    if nodes <= 1 or asked <= 0:
        return asked, None
    mine = held.held(node_id)
    enough = nodes * (asked + mine - 1) + 1  # this many live items give a share of asked + mine
    here = held.holding(job_name)
    queued = queue.count_queued(db, job_name, enough - here) if here < enough else 0
    if here + queued >= enough:
        return asked, None
    # the queue counted whole; the leases too, unless other replicas hold some (node shards)
    live = here + queued if held.elsewhere is None else queue.count_live(db, job_name, enough)
    if live >= enough:
        return asked, live
    return max(0, min(asked, -(-live // nodes) - mine)), live
