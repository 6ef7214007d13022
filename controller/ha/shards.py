"""Node shards: every controller replica on PostgreSQL serves the node protocol for the nodes it owns, so node-call
load spreads over replicas. Used by `replicas.py`, whose work core is fenced by `serving.py`; next step: the owner read once a minute dropped.

Members: each replica renews a row (url, expiry) every RENEW_SECONDS, as the leader renews its lease (same clock,
same bound). Owners: a node is owned by one live member (`node_owners`: owner, and `moves`, bumped by every change
of owner), the least-loaded at its first call. The rows decide every move: when an owner's row runs out, the first
survivor to look takes its nodes (a conditional UPDATE: one move wins); when a member joins, or loads are uneven,
a replica above its fair share hands a node over at the node's next call (`Shards.give`, `hand_over`). Either way
the call is answered 421 naming the new owner (OWNER header; feature owner-redirect, else forwarded there and the reply
names it): the daemon calls it from then on. A daemon that gets no answer from the owner a 421 named goes back to
the replica that named it, saying so (UNREACHABLE header): that replica takes the node over at once (`take_over`,
the same conditional move), so a killed replica's nodes are served again at their next call, not once its row
runs out (the leases of a job with short leases ran out meanwhile: issue #42). A move skipped because the gone
owner's transaction on the node is still open (a paused process) ends that owner's database sessions
(`replica_tables.end_sessions`): the move is made at the next refresh, not when the process resumes.

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

from rolloutd.crds.node import OWNER_HEADER, UNREACHABLE_HEADER

from .leadership import LEASE_SECONDS, RENEW_SECONDS, _now
from ..dialects import PgRaw, insert_rows
from ..store.replica_tables import SESSION, STAMP, ReplicaStageRow, end_sessions

log = logging.getLogger("rolloutd.shards")

OWNER = OWNER_HEADER  # on a forwarded node call's reply: the replica that owns the node (the daemon moves to it)
UNREACHABLE = UNREACHABLE_HEADER  # on a node call sent back: the owner a 421 named gave no answer (`take_over`)
FULL_READ_SECONDS = 60.0  # the owner rows read whole this often (with `replica_tables.DELETIONS_KEPT_SECONDS`)
_MOVE = (f"UPDATE node_owners SET owner = %s, moves = moves + 1, stamp = {STAMP} WHERE node_id = (SELECT node_id "
         "FROM node_owners WHERE node_id = %s AND owner = %s FOR UPDATE SKIP LOCKED) RETURNING moves")


class Shards:
    """This replica's membership and its view of who owns which node (refreshed every `every` seconds by `run`,
    then `on_refresh(owned, moves)`: the nodes owned here and every node's moves, as read)."""

    def __init__(self, engine: Engine, url: str, *, lease_seconds: float = LEASE_SECONDS,
                 every: float = RENEW_SECONDS, session: str = SESSION) -> None:
        self.engine, self.url, self.lease, self.every = engine, url.rstrip("/"), lease_seconds, every
        self.session = session  # the application_name of `engine`'s connections (the member row names it)
        self.members: list[str] = [self.url]
        self.owners: dict[str, str] = {}  # node id → owner url (active nodes)
        self.owned: dict[str, int] = {}  # the nodes owned here → their rows' moves
        self.moves: dict[str, int] = {}  # every active node → its row's moves (as of the last refresh)
        self.give: dict[str, str] = {}  # nodes of ours above our fair share → the member each goes to at its call
        self.taken: dict[str, str] = {}  # nodes taken over from a member their daemon could not reach → that member
        # job → stage → leases: this replica's (set on its loop, `publish`), and the other live members' (read)
        self.local: dict[str, dict[str, int]] = {}
        self.remote: dict[str, dict[str, int]] = {}
        self.on_refresh: Callable[[dict[str, int], dict[str, int]], None] = lambda owned, moves: None
        self._stop = threading.Event()  # the tables are the store's (`store/replica_tables.py`)
        self._view: dict[str, tuple[str, int]] = {}  # every active node → (owner, moves), as last read (`_rows`)
        self._since: int | None = None  # the xmin of the last read's snapshot (None: read every row next)
        self._full_at = 0.0
        self.rows_read = 0  # owner rows the refreshes read (for `bench node_reads`)

    # ------------------------------------------------------------ the rows

    def renew(self) -> None:
        """Our membership extended, and the stages of the leases we hold written (a job's progress sums them)."""
        with self.engine.begin() as c:
            c.exec_driver_sql("INSERT INTO replica_members (url, expires, session) VALUES (%s, %s, %s) ON CONFLICT (url) "
                              "DO UPDATE SET expires = excluded.expires, session = excluded.session",
                              (self.url, _now(c, True) + self.lease, self.session))
            c.exec_driver_sql("DELETE FROM replica_stages WHERE url = %s", (self.url,))
            insert_rows(PgRaw(c.connection.driver_connection), ReplicaStageRow.__table__, ("url", "job", "stage", "n"),
                        [(self.url, job, stage, n) for job, st in self.local.items() for stage, n in st.items()])

    def refresh(self) -> dict[str, int]:
        """Members and owners read; the nodes of members gone moved to live ones; the nodes we hand over at their
        next call planned (`give`). The nodes owned here now, with their rows' moves. The owner rows are read whole
        at the first refresh and every FULL_READ_SECONDS; in between only those stamped since the last read
        (`_rows`)."""
        with self.engine.begin() as c:
            now, xmin = c.exec_driver_sql("SELECT extract(epoch from clock_timestamp()), "
                                          "pg_snapshot_xmin(pg_current_snapshot())::text::bigint").one()
            now = float(now)
            rows = c.exec_driver_sql("SELECT url, expires, session FROM replica_members").fetchall()
            self.members = sorted(u for u, expires, _ in rows if expires > now) or [self.url]
            sessions = {u: session for u, _, session in rows}
            locked: set[str] = set()  # gone owners whose open transaction on a node of theirs skipped its move
            remote: dict[str, dict[str, int]] = {}
            for job, stage, n in c.exec_driver_sql("SELECT job, stage, n FROM replica_stages WHERE url != %s AND url "
                                                   "IN (SELECT url FROM replica_members WHERE expires > %s)",
                                                   (self.url, now)):
                remote.setdefault(job, {})[stage] = n
            self.remote = remote
            view = self._rows(c)
            self._since = int(xmin)
            owners = {node: owner for node, (owner, _) in view.items()}
            moves = {node: m for node, (_, m) in view.items()}
            load = _load(owners, self.members)
            for node, owner in sorted(owners.items()):
                if owner in load:
                    continue
                to = _least(load, node)
                # skipped while the old owner's transaction on it is open (a paused replica's): its sessions are
                # ended below, the node taken next time
                moved = c.exec_driver_sql(_MOVE, (to, node, owner)).scalar()
                if moved is None:
                    locked.add(owner)
                    continue
                owners[node], moves[node] = to, int(moved)
                view[node] = (to, int(moved))
                load[to] += 1
                log.info("node %s moved from %s (gone) to %s", node, owner, to)
        for owner in sorted(locked):  # their locks released, their nodes move at the next refresh
            end_sessions(self.engine, sessions.get(owner, ""), f"member {owner} ran out with a node's row locked")
        self.owners, self.moves = owners, {n: int(m) for n, m in moves.items()}
        # an owner a daemon could not reach is planned none of our nodes while it is a member (a killed one, until its
        # row runs out; one that daemons cannot reach: a node handed to it would come back at the next call)
        self.taken = {n: o for n, o in self.taken.items() if owners.get(n) == self.url and o in self.members}
        shunned = set(self.taken.values())
        self.give = _plan(owners, [m for m in self.members if m not in shunned], self.url)
        return {n: self.moves[n] for n, o in owners.items() if o == self.url}

    def _rows(self, c: Any) -> dict[str, tuple[str, int]]:
        """Every active node's (owner, moves): read whole, or our last view with the rows stamped since it (each
        write of an owner row stamps it with its transaction's id, `STAMP`; a node gone stamps its row too,
        `Serving.gone`). Stamps at or above the oldest transaction still open at our last read (`_since`, its
        snapshot's xmin) cover every write that read could not see, committed in any order since. A deleted row (its
        job purged) leaves a record with the stamp of the deleting transaction (`replica_tables.delete_owners`)."""
        if self._since is None or time.monotonic() >= self._full_at:
            self._view = {node: (owner, int(m)) for node, owner, m in c.exec_driver_sql(
                "SELECT o.node_id, o.owner, o.moves FROM node_owners o JOIN nodes n ON n.id = o.node_id "
                "WHERE n.state != 'gone'")}
            self._full_at = time.monotonic() + FULL_READ_SECONDS  # (well before the deletions' records go)
            self.rows_read += len(self._view)
            return dict(self._view)
        # the upper bound is for the planner: a range is estimated narrow (the index) before the table has statistics,
        # a bare `>=` a third of it (read whole); each changed row's node state read by its key (a join read all)
        changed = c.exec_driver_sql("SELECT o.node_id, o.owner, o.moves, (SELECT n.state FROM nodes n WHERE n.id = "
                                    "o.node_id) FROM node_owners o WHERE o.stamp BETWEEN %s AND 9223372036854775807",
                                    (self._since,)).fetchall()
        deleted = c.exec_driver_sql("SELECT node_id FROM node_owner_deletions WHERE stamp BETWEEN %s AND "
                                    "9223372036854775807", (self._since,)).fetchall()
        self.rows_read += len(changed) + len(deleted)
        for node, owner, m, state in changed:
            if state is None or state == "gone":
                self._view.pop(node, None)
            else:
                self._view[node] = (owner, int(m))
        for (node,) in deleted:  # (a row deleted after `changed` read it: its record is read next time too)
            self._view.pop(node, None)
        return dict(self._view)

    def assign(self, node_id: str) -> str:
        """A node just registered: owned by the least-loaded live member (a concurrent assignment's row wins)."""
        to = _least(_load(self.owners, self.members), node_id)
        with self.engine.begin() as c:
            c.exec_driver_sql(f"INSERT INTO node_owners (node_id, owner, moves, stamp) VALUES (%s, %s, 1, {STAMP}) "
                              "ON CONFLICT DO NOTHING", (node_id, to))
            to = c.exec_driver_sql("SELECT owner FROM node_owners WHERE node_id = %s", (node_id,)).scalar() or to
        self.owners[node_id] = to
        return to

    def owner(self, node_id: str) -> str:
        """The node's owner as its row says now (assigned now when it has none: its first call after registering)."""
        with self.engine.connect() as c:
            owner = c.exec_driver_sql("SELECT owner FROM node_owners WHERE node_id = %s", (node_id,)).scalar()
        if owner is None:
            return self.assign(node_id)
        self.owners[node_id] = owner
        return owner

    def _move(self, node_id: str, frm: str, to: str) -> bool:
        """The node from `frm` to `to` by the conditional move (`_MOVE`: only from `frm`, not while a call of `frm`
        on it is open; one move wins), in our view too when it moved."""
        with self.engine.begin() as c:
            moved = c.exec_driver_sql(_MOVE, (to, node_id, frm)).scalar() is not None
        if moved:
            self.owners[node_id] = to
        return moved

    def hand_over(self, node_id: str, to: str) -> bool:
        """Our node to member `to` (its `give` plan), unless it is ours no more or a call of ours on it is open."""
        moved = self._move(node_id, self.url, to)
        if moved:
            log.info("node %s handed over to %s", node_id, to)
        return moved

    def take_over(self, node_id: str, owner: str) -> bool:
        """The node of `owner`, which its daemon could not reach, ours now: the same conditional move as a dead
        member's, so not while a call of the owner on it is open (a paused replica's), and only from the owner named
        (one move wins). The owner's fence refuses its calls of the node from the commit on."""
        moved = self._move(node_id, owner, self.url)
        if moved:
            self.taken[node_id] = owner
            log.info("node %s taken over from %s (its daemon could not reach it)", node_id, owner)
        return moved

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
                self.owned = self.refresh()
            except Exception as e:  # noqa: BLE001 - the database away: the next pass tries again
                log.warning("shards: %s", e)
                continue
            self.on_refresh(self.owned, self.moves)


def _load(owners: dict[str, str], members: list[str]) -> dict[str, int]:
    load = {m: 0 for m in members}
    for owner in owners.values():
        if owner in load:
            load[owner] += 1
    return load


def _least(load: dict[str, int], node_id: str) -> str:
    """The least-loaded member (ties broken by the node's hash, so registrations at once spread)."""
    low = min(load.values())
    ties = sorted(m for m, n in load.items() if n == low)
    return ties[int(hashlib.blake2b(node_id.encode(), digest_size=4).hexdigest(), 16) % len(ties)]


def _plan(owners: dict[str, str], members: list[str], me: str) -> dict[str, str]:
    """Our nodes above our fair share (⌈nodes ÷ members⌉), each to the least-loaded member still below its floor
    share (⌊nodes ÷ members⌋): a member that joined gets its share from each replica above the share. Every
    replica plans for its own nodes only; one that gives too much (two giving to one joiner at once) is above its
    share at the next refresh and gives back."""
    load = _load(owners, members)
    if me not in load or len(load) < 2:
        return {}
    total = sum(load.values())
    high, low = -(-total // len(load)), total // len(load)
    give: dict[str, str] = {}
    for node in sorted((n for n, o in owners.items() if o == me), key=lambda n: hashlib.blake2b(n.encode()).digest()):
        if load[me] <= high:
            break
        to = min((m for m in load if m != me), key=lambda m: (load[m], m))
        if load[to] >= low:
            break
        give[node] = to
        load[to] += 1
        load[me] -= 1
    return give
