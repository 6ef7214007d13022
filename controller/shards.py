"""Node shards: every controller replica on PostgreSQL serves the node protocol for the nodes it owns, so node-call
load spreads over replicas. Used by `replicas.py`; next step: move nodes to a replica that joins (only new ones go).

Members: each replica renews a row (url, expiry) every RENEW_SECONDS, as the leader renews its lease (same clock,
same bound). Owners: a node is owned by one live member (`node_owners`), the least-loaded at its registration;
when its owner's row runs out, the first survivor to look moves it to the least-loaded live member (a conditional
UPDATE on the old owner: one move wins). The owner serves the node's lease, beat and result calls from memory
exactly as a single controller does (held leases, liveness, admission); another replica forwards such a call to
the owner and names it (OWNER header) so the daemon calls it directly from then on. A replica that gains a node
loads its held leases from the database with a whole lease from now (`adopt`, as a restarted controller does);
one that loses it forgets them in memory without writing. Two replicas' writes on the same rows are safe by the
store's locks (`work/hot_sql.py`: SKIP LOCKED grants, locked results and expiry; `work/feed.py`: ordered seqs).

Global caps: a backend's (and a job's) admission cap is split evenly over the live members (`Admission.replicas`,
rounded up): counting it in the database would put a write on every grant and release, the hot path this removes.
"""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any, Callable

from sqlalchemy.engine import Engine

from rolloutd.crds.node import OWNER_HEADER

from .leadership import LEASE_SECONDS, RENEW_SECONDS, _now
from .work.held_leases import HeldLease

log = logging.getLogger("rolloutd.shards")

OWNER = OWNER_HEADER  # on a forwarded node call's reply: the replica that owns the node (the daemon moves to it)
_CREATE = ("CREATE TABLE IF NOT EXISTS replica_members (url TEXT PRIMARY KEY, expires DOUBLE PRECISION NOT NULL)",
           "CREATE TABLE IF NOT EXISTS node_owners (node_id TEXT PRIMARY KEY, owner TEXT NOT NULL)",
           "CREATE TABLE IF NOT EXISTS replica_stages (url TEXT NOT NULL, job TEXT NOT NULL, stage TEXT NOT NULL, "
           "n INTEGER NOT NULL, PRIMARY KEY (url, job, stage))")


class Shards:
    """This replica's membership and its view of who owns which node (refreshed every `every` seconds by `run`;
    `on_change(owned)` when the nodes it owns changed)."""

    def __init__(self, engine: Engine, url: str, *, lease_seconds: float = LEASE_SECONDS,
                 every: float = RENEW_SECONDS) -> None:
        self.engine, self.url, self.lease, self.every = engine, url.rstrip("/"), lease_seconds, every
        self.members: list[str] = [self.url]
        self.owners: dict[str, str] = {}  # node id → owner url (active nodes)
        self.owned: set[str] = set()
        # job → stage → leases: this replica's (set on its loop, `publish`), and the other live members' (read)
        self.local: dict[str, dict[str, int]] = {}
        self.remote: dict[str, dict[str, int]] = {}
        self.on_change: Callable[[set[str]], None] = lambda owned: None
        self._stop = threading.Event()
        with engine.begin() as c:
            for sql in _CREATE:
                c.exec_driver_sql(sql)

    # ------------------------------------------------------------ the rows

    def renew(self) -> None:
        """Our membership extended, and the stages of the leases we hold written (a job's progress sums them)."""
        with self.engine.begin() as c:
            c.exec_driver_sql("INSERT INTO replica_members (url, expires) VALUES (%s, %s) ON CONFLICT (url) DO UPDATE "
                              "SET expires = excluded.expires", (self.url, _now(c, True) + self.lease))
            c.exec_driver_sql("DELETE FROM replica_stages WHERE url = %s", (self.url,))
            rows = [(self.url, job, stage, n) for job, st in self.local.items() for stage, n in st.items()]
            if rows:
                c.connection.driver_connection.cursor().executemany(
                    "INSERT INTO replica_stages (url, job, stage, n) VALUES (%s, %s, %s, %s)", rows)

    def refresh(self) -> set[str]:
        """Members and owners read; the nodes of members gone moved to live ones. The nodes owned here now."""
        with self.engine.begin() as c:
            now = _now(c, True)
            self.members = sorted(u for (u,) in c.exec_driver_sql(
                "SELECT url FROM replica_members WHERE expires > %s", (now,))) or [self.url]
            remote: dict[str, dict[str, int]] = {}
            for job, stage, n in c.exec_driver_sql("SELECT job, stage, n FROM replica_stages WHERE url != %s AND url "
                                                   "IN (SELECT url FROM replica_members WHERE expires > %s)",
                                                   (self.url, now)):
                remote.setdefault(job, {})[stage] = n
            self.remote = remote
            rows = c.exec_driver_sql("SELECT o.node_id, o.owner FROM node_owners o JOIN nodes n ON n.id = o.node_id "
                                     "WHERE n.state != 'gone'").fetchall()
            owners = dict(rows)
            load = {m: 0 for m in self.members}
            for owner in owners.values():
                if owner in load:
                    load[owner] += 1
            for node, owner in sorted(owners.items()):
                if owner in load:
                    continue
                to = _least(load, node)
                if c.exec_driver_sql("UPDATE node_owners SET owner = %s WHERE node_id = %s AND owner = %s",
                                     (to, node, owner)).rowcount == 1:
                    owners[node] = to
                    load[to] += 1
                    log.info("node %s moved from %s (gone) to %s", node, owner, to)
        self.owners = owners
        return {n for n, o in owners.items() if o == self.url}

    def assign(self, node_id: str) -> str:
        """A node just registered: owned by the least-loaded live member (a concurrent assignment's row wins)."""
        load = {m: 0 for m in self.members}
        for owner in self.owners.values():
            if owner in load:
                load[owner] += 1
        to = _least(load, node_id)
        with self.engine.begin() as c:
            c.exec_driver_sql("INSERT INTO node_owners (node_id, owner) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                              (node_id, to))
            to = c.exec_driver_sql("SELECT owner FROM node_owners WHERE node_id = %s", (node_id,)).scalar() or to
        self.owners[node_id] = to
        return to

    def owner(self, node_id: str) -> str:
        """The node's owner: this replica's view, else the row (a node another replica saw first), else assigned
        now (its first call after registering: `assign`)."""
        owner = self.owners.get(node_id)
        if owner is None:
            with self.engine.connect() as c:
                owner = c.exec_driver_sql("SELECT owner FROM node_owners WHERE node_id = %s", (node_id,)).scalar()
            if owner is None:
                return self.assign(node_id)
            self.owners[node_id] = owner
        return owner

    def elsewhere(self, job: str) -> dict[str, int]:
        """Stage → the job's leases held by the other live replicas (as of their last renewal)."""
        return self.remote.get(job, {})

    def resign(self) -> None:
        """A graceful stop: our row runs out now, so our nodes move at the survivors' next refresh."""
        try:
            with self.engine.begin() as c:
                c.exec_driver_sql("UPDATE replica_members SET expires = 0 WHERE url = %s", (self.url,))
        except Exception as e:  # noqa: BLE001 - it runs out on its own
            log.warning("could not hand the membership back: %s", e)

    # ------------------------------------------------------------ the loop

    def start(self) -> "Shards":
        self.renew()
        self.owned = self.refresh()
        threading.Thread(target=self.run, name="shards", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.renew()
                owned = self.refresh()
            except Exception as e:  # noqa: BLE001 - the database away: the next pass tries again
                log.warning("shards: %s", e)
                continue
            if owned != self.owned:
                self.owned = owned
                self.on_change(owned)


def _least(load: dict[str, int], node_id: str) -> str:
    """The least-loaded member (ties broken by the node's hash, so registrations at once spread)."""
    low = min(load.values())
    ties = sorted(m for m, n in load.items() if n == low)
    return ties[int(hashlib.blake2b(node_id.encode(), digest_size=4).hexdigest(), 16) % len(ties)]


def adopt(work: Any, owned: set[str], before: set[str] | None, now: float | None = None) -> tuple[int, int]:
    """The work core serves `owned` (it served `before`; None: a core just built, holding every lease of the
    database): the held leases of nodes it lost are forgotten (memory only, their backend slots freed here), those
    of nodes it gained loaded from the database with a whole lease from now. A node assigned here since `owned` was
    read keeps what it holds (it is in the next `owned`). Returns (forgotten, loaded)."""
    held, queue, registry = work.queue.leases, work.queue, work.registry
    now = work.clock() if now is None else now
    registry.serves = owned.__contains__
    gone = (lambda n: n not in owned) if before is None else (before - owned).__contains__
    lost = [(aid, live) for aid, live in held.by_attempt.items() if gone(live.node_id)]
    for aid, live in lost:
        queue.release(live)
        held.forget(aid)
    gained = sorted(owned - (before or set()))
    loaded = 0
    if gained:
        with work.store.engine.connect() as c:
            rows = c.exec_driver_sql(
                "SELECT id, job, node_id, attempt_id, stage, backend, holds_backend, deadline FROM items "
                "WHERE state = 'leased' AND node_id = ANY(%s)", (gained,)).fetchall()
        for item, job, node_id, aid, stage, backend, holds, deadline in rows:
            if aid is None or aid in held.by_attempt:
                continue
            if holds and backend:
                work.pool.take(backend, job)
            held.add(aid, HeldLease(item, job, node_id, stage or "leased", backend, bool(holds),
                                    max(deadline or 0.0, now + work.lease_seconds(job)), since=now, beat=now))
            loaded += 1
        for node_id in gained:  # silent from now on only: it called another replica until now
            registry.seen(node_id, now)
    return len(lost), loaded
