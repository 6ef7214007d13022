"""The replicas' tables (ROLLOUTD_REPLICAS): the leader lease (`leadership.py`), and the node shards' members, owners,
owner deletions and stage counts (`shards.py`). Part of the store's schema and its migrations (`schema.py`, versions 4 to
6): created with the others, never by the code that uses them; next step: a migration for each new column.
"""
from __future__ import annotations

import logging
import uuid
from typing import Any

from sqlalchemy import BigInteger, Column, Double, Index, Integer, Text
from sqlalchemy.engine import Engine
from sqlmodel import Field, SQLModel

log = logging.getLogger("rolloutd.sessions")

# this process's PostgreSQL connections carry this name (their application_name, `db.StoreDB`); its member row and its
# lease name it (version 7), so a replica taking over from one whose row ran out can end its sessions (`end_sessions`)
SESSION = f"rolloutd-{uuid.uuid4().hex[:12]}"
STAMP = "pg_current_xact_id()::text::bigint"  # an owner row's `stamp`: the id of the transaction that wrote it
# an owner deletion's record is kept this long: a replica that has not read by stamp for a minute reads the owner rows
# whole (`shards.FULL_READ_SECONDS`), so it needs no record older than that and its longest transaction
DELETIONS_KEPT_SECONDS = 300.0
END_WAIT_MS = 5000  # how long ending a session may wait for it to exit (PostgreSQL 14 or newer take a timeout)


class LeaderLeaseRow(SQLModel, table=True):
    """One row (id 1): who leads, at which epoch (the fence), until when (the clock of `leadership._now`)."""
    __tablename__ = "leader_lease"
    id: int = Field(sa_column=Column(Integer, primary_key=True, autoincrement=False))
    holder: str = Field(sa_column=Column(Text, nullable=False))
    epoch: int = Field(sa_column=Column(BigInteger, nullable=False))
    expires: float = Field(sa_column=Column(Double, nullable=False))
    url: str = Field(sa_column=Column(Text, nullable=False))
    session: str = Field(sa_column=Column(Text, nullable=False, server_default=""))  # the holder's (version 7)


class ReplicaMemberRow(SQLModel, table=True):
    __tablename__ = "replica_members"
    url: str = Field(sa_column=Column(Text, primary_key=True))
    expires: float = Field(sa_column=Column(Double, nullable=False))
    session: str = Field(sa_column=Column(Text, nullable=False, server_default=""))  # the member's (version 7)


class NodeOwnerRow(SQLModel, table=True):
    """A node's owner; `moves` is bumped by every change of owner (the fence's epoch); `stamp` (version 5) is the id
    of the transaction that last wrote the row, or retired its node: a replica reads only rows stamped since its
    last read (`shards.Shards._rows`), through their index."""
    __tablename__ = "node_owners"
    __table_args__ = (Index("ix_node_owners_stamp", "stamp"),)
    node_id: str = Field(sa_column=Column(Text, primary_key=True))
    owner: str = Field(sa_column=Column(Text, nullable=False))
    moves: int = Field(sa_column=Column(BigInteger, nullable=False, server_default="0"))
    stamp: int = Field(sa_column=Column(BigInteger, nullable=False, server_default="0"))


class NodeOwnerDeletionRow(SQLModel, table=True):
    """An owner row deleted (its job purged: `delete_owners`), stamped as the row's writes were (version 6): a
    replica reading the rows stamped since its last read drops the node from its view (a deleted row has no stamp)."""
    __tablename__ = "node_owner_deletions"
    __table_args__ = (Index("ix_node_owner_deletions_stamp", "stamp"),)
    node_id: str = Field(sa_column=Column(Text, primary_key=True))
    stamp: int = Field(sa_column=Column(BigInteger, nullable=False))
    at: float = Field(sa_column=Column(Double, nullable=False))  # the server's clock (epoch seconds) when deleted


class ReplicaStageRow(SQLModel, table=True):
    """The leases one replica holds, per job and stage (a job's progress sums every live replica's)."""
    __tablename__ = "replica_stages"
    url: str = Field(sa_column=Column(Text, primary_key=True))
    job: str = Field(sa_column=Column(Text, primary_key=True))
    stage: str = Field(sa_column=Column(Text, primary_key=True))
    n: int = Field(sa_column=Column(Integer, nullable=False))


REPLICA_TABLES = (LeaderLeaseRow, ReplicaMemberRow, NodeOwnerRow, NodeOwnerDeletionRow, ReplicaStageRow)
LEASE_SEED = "INSERT INTO leader_lease (id, holder, epoch, expires, url) VALUES (1, '', 0, 0, '') ON CONFLICT DO NOTHING"


def delete_owners(c: Any, job: str, pg: bool) -> None:
    """In the transaction that purges `job`'s nodes (`work.tables.purge`), before the nodes go: their owner rows
    deleted; on PostgreSQL (the replicas' store) each deletion recorded with its stamp, and the records older than
    DELETIONS_KEPT_SECONDS removed."""
    nodes = "SELECT id FROM nodes WHERE job = %s" if pg else "SELECT id FROM nodes WHERE job = ?"
    if pg:
        now = "extract(epoch from clock_timestamp())"
        c.exec_driver_sql(f"DELETE FROM node_owner_deletions WHERE at < {now} - %s", (DELETIONS_KEPT_SECONDS,))
        c.exec_driver_sql(f"INSERT INTO node_owner_deletions (node_id, stamp, at) SELECT node_id, {STAMP}, {now} "
                          f"FROM node_owners WHERE node_id IN ({nodes}) ON CONFLICT (node_id) DO UPDATE "
                          "SET stamp = excluded.stamp, at = excluded.at", (job,))
    c.exec_driver_sql(f"DELETE FROM node_owners WHERE node_id IN ({nodes})", (job,))


def end_sessions(engine: Engine, session: str, why: str) -> int:
    """End the database sessions named `session`: a replica whose row ran out while a transaction of it stayed open
    (a paused process's), whose locks would hold what it lost (its nodes, the lease) until it resumed. Their
    transactions roll back; once resumed it commits nothing and its pool reconnects. Never this process's own; 0
    when the server refuses (another database role without pg_signal_backend): then the locks are waited for."""
    if not session or session == SESSION:
        return 0
    try:
        with engine.begin() as c:
            # the timeout waits for each session to be gone: without it the signal is only sent, and a next try
            # (the lease's, within milliseconds) could still find the row locked by a session about to exit
            ended = c.exec_driver_sql("SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, %s)) "
                                      "FROM pg_stat_activity WHERE application_name = %s AND pid != pg_backend_pid()",
                                      (END_WAIT_MS, session)).scalar()
    except Exception as e:  # noqa: BLE001 - not ours to end: its locks are waited for, as before
        log.warning("could not end the database sessions of %s (%s): %s", session, why, e)
        return 0
    if ended:
        log.warning("ended %d database session(s) of %s: %s", ended, session, why)
    return int(ended or 0)
