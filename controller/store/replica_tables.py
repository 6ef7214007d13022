"""The replicas' tables (ROLLOUTD_REPLICAS): the leader lease (`leadership.py`), and the node shards' members, owners
and stage counts (`shards.py`). Part of the store's schema and its migrations (`schema.py`, versions 4 and 5): created with
the others, never by the code that uses them; next step: a migration for each new column.
"""
from __future__ import annotations

from sqlalchemy import BigInteger, Column, Double, Index, Integer, Text
from sqlmodel import Field, SQLModel


class LeaderLeaseRow(SQLModel, table=True):
    """One row (id 1): who leads, at which epoch (the fence), until when (the clock of `leadership._now`)."""
    __tablename__ = "leader_lease"
    id: int = Field(sa_column=Column(Integer, primary_key=True, autoincrement=False))
    holder: str = Field(sa_column=Column(Text, nullable=False))
    epoch: int = Field(sa_column=Column(BigInteger, nullable=False))
    expires: float = Field(sa_column=Column(Double, nullable=False))
    url: str = Field(sa_column=Column(Text, nullable=False))


class ReplicaMemberRow(SQLModel, table=True):
    __tablename__ = "replica_members"
    url: str = Field(sa_column=Column(Text, primary_key=True))
    expires: float = Field(sa_column=Column(Double, nullable=False))


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


class ReplicaStageRow(SQLModel, table=True):
    """The leases one replica holds, per job and stage (a job's progress sums every live replica's)."""
    __tablename__ = "replica_stages"
    url: str = Field(sa_column=Column(Text, primary_key=True))
    job: str = Field(sa_column=Column(Text, primary_key=True))
    stage: str = Field(sa_column=Column(Text, primary_key=True))
    n: int = Field(sa_column=Column(Integer, nullable=False))


REPLICA_TABLES = (LeaderLeaseRow, ReplicaMemberRow, NodeOwnerRow, ReplicaStageRow)
LEASE_SEED = "INSERT INTO leader_lease (id, holder, epoch, expires, url) VALUES (1, '', 0, 0, '') ON CONFLICT DO NOTHING"
