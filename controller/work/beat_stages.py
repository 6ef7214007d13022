"""A beat's stages against the leases held in memory (`apply`): renewed, their backend released or re-pinned. Called
by `attempts.Attempts.beat`. Next step: `held_leases.py`.
"""
from __future__ import annotations

import sqlite3

from rolloutd.crds.node import Heartbeat, HeartbeatResponse

from . import hot_sql
from .held_leases import HeldLease
from .job_state import JobCache
from .queue import ItemQueue


def apply(queue: ItemQueue, db: sqlite3.Connection, node_id: str, job_name: str, cache: JobCache, hb: Heartbeat,
            ended: set[str], now: float, resp: HeartbeatResponse) -> None:
    """The beat's stages, against the leases held in memory, where a stage changes and a full beat renews
    what it names; a released or re-pinned backend is also written to the database. An attempt not held in
    memory is no lease of this node's any more: cancelled (its job or group was) or unknown (it expired, or is
    not this node's)."""
    held_now, pool = queue.leases, queue.pool
    changed: dict[int, HeldLease] = {}
    until = now + cache.lease_seconds

    def release(held: HeldLease) -> None:
        if held.holds_backend:
            queue.release(held)
            changed[held.item] = held

    for aid in hb.left_run:
        held = held_now.get(aid)
        if held is not None and held.node_id == node_id:
            release(held)
    gone = []
    for aid, stage in hb.stages.items():
        if aid in ended:
            continue
        held = held_now.get(aid)
        if held is None or held.node_id != node_id:
            gone.append(aid)
            continue
        held_now.heard(held, stage, now)  # in memory only: the database keeps the stage of the grant
        backend = held.backend
        if stage in ("leased", "init") and backend \
                and (not pool.healthy(backend) or backend not in cache.backends):
            new = pool.acquire(cache.backends, job_name)
            if new is not None:
                release(held)
                held.backend, held.holds_backend = new, True
                changed[held.item] = held
                resp.repin[aid] = new
        # Only the leases a full beat names are extended. One granted but not yet in a beat is
        # covered by its own deadline (lease_seconds from the grant); one whose lease answer
        # never reached the daemon (the controller died while sending it) is named by nobody
        # and goes back to the queue when that deadline passes.
        if hb.full:
            held_now.renew(aid, held, until)
    held_now.set_turns(node_id, hb.turns)
    if gone and (gone := held_now.readopt(db, node_id, gone, until, pool.take)):  # held: the database says so
        cancelled = hot_sql.cancelled(db, gone)
        for aid in gone:
            (resp.cancel if aid in cancelled else resp.unknown).append(aid)
    if changed:  # a backend released or re-pinned: admission is restored from these after a restart
        hot_sql.save_pins(db, ((h.backend, h.holds_backend, h.item) for h in changed.values()))

