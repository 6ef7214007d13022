"""The node-shard fence: the nodes one work core serves (`Serving`), checked first in every node call's transaction;
a call for a node this replica does not own is `NotOwner`. Built by `replicas.py` over `shards.Shards`' view.

The fence (`Serving.check_ahead`): every node call's transaction first reads the node's owner row `FOR SHARE`; a replica
that is not the owner answers nothing from its memory and commits nothing (`NotOwner`: `replicas.py` redirects or
forwards the call to the owner), and a move waits for the owner's open transactions on that node, so once it committed no
earlier owner commits for the node again (a replica paused past its row's lapse included). A work core serves a
node's calls from memory (held leases, liveness, admission) exactly as a single controller does, for the `moves` it
loaded the node's leases at: a node that moved (away and back included) is loaded again from the database, with a
whole lease from now, before its call is answered; one that left is forgotten in memory without writing. Two
replicas' writes on the same rows are safe by the store's locks (`work/hot_sql.py`: SKIP LOCKED grants, locked
results and expiry; `work/feed.py`: ordered seqs).
"""
from __future__ import annotations

from typing import Any, Callable

from rolloutd.crds.node import OWNER_HEADER

from ..dialects import raw
from ..errors import ServiceUnavailable
from ..store.replica_tables import STAMP
from ..work.held_leases import HeldLease
from ..work.hot_sql import ahead
from .shards import Shards


class NotOwner(ServiceUnavailable):
    """A node call reached a replica that does not own the node now: nothing was answered from its memory and its
    transaction is rolled back; 503 naming the owner (`replicas.py` answers 421 naming it, or forwards the call there)."""

    def __init__(self, node_id: str, owner: str) -> None:
        super().__init__(f"node {node_id} is served by {owner or 'no replica yet'}: retry there")
        self.owner = owner
        self.headers = {OWNER_HEADER: owner} if owner else {}


class Serving:
    """The nodes one work core (a follower's, or the leader's) serves, each at the `moves` of its owner row when the
    core loaded its held leases; `check_ahead` is its fence (`NodeRegistry.owning`: every node call's transaction
    runs it first), `ours` the expiry's. `sync` follows the rows' view each refresh: nodes gained are loaded now (their
    leases expire here if their daemon never calls again), nodes lost forgotten."""

    def __init__(self, shards: Shards, work: Any) -> None:
        self.shards, self.work = shards, work
        self.held: dict[str, int] = {}  # node → the moves its leases were loaded at
        work.registry.owning = self
        work.registry.serves = self.held.__contains__
        work.registry.served = lambda: list(self.held)

    def check_ahead(self, db: Any, node_id: str) -> Callable[[], None]:
        """In a node call's transaction, before anything is read or written for it: the node's owner row locked
        `FOR SHARE` to the commit (so no move commits meanwhile), sent now and judged by the function returned
        (`work/hot_sql.ahead`: on PostgreSQL it shares the round trip of the call's first reads): the node is ours
        (else `NotOwner`), and its leases are loaded at the row's moves."""
        row = ahead(db, "SELECT owner, moves FROM node_owners WHERE node_id = ? FOR SHARE", (node_id,))
        return lambda: self._judge(db, node_id, row())

    def _judge(self, db: Any, node_id: str, row: Any) -> None:
        if row is None or row[0] != self.shards.url:
            if node_id in self.held:
                self.drop({node_id})
            raise NotOwner(node_id, row[0] if row else "")
        if self.held.get(node_id) != row[1]:
            self.take(db, {node_id: int(row[1])})

    def gone(self, db: Any, nodes: list[str]) -> None:
        """In the transaction that retires `nodes` (state gone): their owner rows stamped, so the replicas' next
        refresh (`Shards._rows`) drops them from their view."""
        db.execute(f"UPDATE node_owners SET stamp = {STAMP} WHERE node_id = ANY(?)", (sorted(nodes),))

    def ours(self, db: Any, late: dict[str, HeldLease]) -> dict[str, HeldLease]:
        """The expiry's fence: those of the `late` leases whose nodes are ours now at the moves we loaded them at
        (their rows held `FOR SHARE` to the commit); the others are their owner's to expire: forgotten here."""
        rows = db.execute("SELECT node_id, owner, moves FROM node_owners WHERE node_id = ANY(?) FOR SHARE",
                          (sorted({live.node_id for live in late.values()}),)).fetchall()
        mine = {n for n, owner, moves in rows if owner == self.shards.url and self.held.get(n) == moves}
        for node in {live.node_id for live in late.values()} - mine:
            self.drop({node})
        return {aid: live for aid, live in late.items() if live.node_id in mine}

    def sync(self, owned: dict[str, int], moves: dict[str, int], reset: bool = False) -> tuple[int, int]:
        """On the loop, after a refresh that read `owned` (ours: node → moves) and every node's `moves`: the nodes that
        left us since we loaded them are forgotten, those we gained loaded; a node loaded at a later move than the
        refresh read (by a call's fence meanwhile) is left as it is. `reset`: a core just built (whatever it loaded
        is forgotten, the nodes owned loaded again). Returns (nodes forgotten, leases loaded)."""
        if reset:
            for live in list(self.work.queue.leases.by_attempt.values()):
                self.held.setdefault(live.node_id, -1)
        lost = {n for n, m in self.held.items() if n not in owned and moves.get(n, -1) >= m}
        self.drop(lost)
        gained = {n: m for n, m in owned.items() if self.held.get(n, -1) < m}
        loaded = 0
        if gained:
            with self.work.store.engine.connect() as c:
                loaded = self.take(raw(c), gained)
        return len(lost), loaded

    def drop(self, nodes: set[str]) -> None:
        """Forget the held leases of `nodes` (memory only: their backend slots freed here)."""
        queue = self.work.queue
        for node in nodes:
            queue.forget_held(queue.leases.attempts_on(node))
            self.held.pop(node, None)

    def take(self, db: Any, nodes: dict[str, int]) -> int:
        """Load the held leases of `nodes` from the database with a whole lease from now (as a restarted controller
        does), whatever was held of them forgotten first. Returns how many."""
        work = self.work
        held, now = work.queue.leases, work.clock()
        self.drop(set(nodes))
        rows = db.execute("SELECT id, job, node_id, attempt_id, stage, backend, holds_backend, deadline FROM items "
                          "WHERE state = 'leased' AND node_id = ANY(?)", (sorted(nodes),)).fetchall()
        for item, job, node_id, aid, stage, backend, holds, deadline in rows:
            if aid is None:
                continue
            if holds and backend:
                work.pool.take(backend, job)
            held.add(aid, HeldLease(item, job, node_id, stage or "leased", backend, bool(holds),
                                    max(deadline or 0.0, now + work.lease_seconds(job)), since=now, beat=now))
        for node_id, moves in nodes.items():  # silent from now on only: it called another replica until now
            work.registry.seen(node_id, now)
            self.held[node_id] = moves
        return len(rows)
