"""The controller's SQLite tables, their migrations and the rendering of a job row into its API form.

Used by `store.py` (the only writer) and nothing else. SCHEMA_VERSION and MIGRATIONS move an older
database forward on open; next step: a migration for each new column, never an edited table.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import inspect
from sqlmodel import Field, Session, SQLModel

from rolloutd.crds.rolloutjob import API_VERSION, DEFAULT_NAMESPACE, KIND, RolloutJob

from ..errors import ApiError
from .replica_tables import (LEASE_SEED, REPLICA_TABLES, LeaderLeaseRow, NodeOwnerDeletionRow, NodeOwnerRow,
                             ReplicaMemberRow)

SCHEMA_VERSION = 7  # 2: namespace, finalizers, ownerReferences, managedFields; 3: keyed by (namespace, name);
# 4: the replicas' tables (`replica_tables.py`: the leader lease, node shards), made by the code using them before;
# 5: node_owners.stamp and its index (a replica reads the owner rows written since its last read);
# 6: node_owner_deletions (a purged job's owner rows deleted, each deletion stamped for the replicas to read);
# 7: the leader lease's and the members' session (their database sessions, ended when a row ran out locked)
# Held by every job until the reconciler released what the executor started (`Store.remove`).
RELEASE_FINALIZER = "rolloutd.io/release"


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


class SchemaVersionRow(SQLModel, table=True):
    __tablename__ = "schema_version"
    id: int = Field(default=1, primary_key=True)
    version: int


class JobRow(SQLModel, table=True):
    __tablename__ = "jobs"
    namespace: str = Field(default=DEFAULT_NAMESPACE, primary_key=True, sa_column_kwargs={"server_default": DEFAULT_NAMESPACE})
    name: str = Field(primary_key=True)
    uid: str
    generation: int
    resource_version: int
    labels: str  # JSON
    annotations: str  # JSON
    spec: str  # JSON, wire form (camelCase)
    status: str  # JSON, wire form
    created: datetime
    deleted: datetime | None = None
    finalizers: str = Field(default="[]", sa_column_kwargs={"server_default": "[]"})  # JSON
    owner_refs: str = Field(default="[]", sa_column_kwargs={"server_default": "[]"})  # JSON
    managed: str = Field(default="[]", sa_column_kwargs={"server_default": "[]"})  # JSON: managedFields (SSA)


class ChangeRow(SQLModel, table=True):
    __tablename__ = "changes"
    rv: int | None = Field(default=None, primary_key=True)
    type: str  # ADDED | MODIFIED | DELETED
    name: str = Field(index=True)  # the job's key (`names.job_key`)
    object: str  # JSON, the whole resource after the change


class EventRow(SQLModel, table=True):
    __tablename__ = "events"
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True)  # the job's key (`names.job_key`)
    time: datetime
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Change:
    rv: int
    type: str
    name: str
    object: dict[str, Any]


class Unservable(ApiError):
    """A stored row that cannot be rendered (written by hand or by an older, laxer version)."""

    def __init__(self, name: str, cause: Exception):
        super().__init__(f'rolloutjobs "{name}" is stored in a form this controller cannot serve '
                         f'({type(cause).__name__}: {str(cause)[:200]}); delete it and apply it again', name=name)


def _no_constant(value: str) -> Any:
    raise ValueError(f"non-finite number {value} (JSON has none)")


def to_resource(row: JobRow) -> RolloutJob:
    try:
        return RolloutJob.model_validate(to_wire(row))
    except ValueError as e:  # pydantic's ValidationError is one
        raise Unservable(row.name, e) from None


def servable_wire(row: JobRow) -> dict[str, Any]:
    """`to_wire`, refusing what cannot be sent as JSON (NaN, Infinity) or parsed at all."""
    try:
        return to_wire(row, loads=_strict_loads)
    except ValueError as e:  # json.JSONDecodeError is one
        raise Unservable(row.name, e) from None


def _strict_loads(text: str) -> Any:
    return json.loads(text, parse_constant=_no_constant)


def to_wire(row: JobRow, loads=json.loads) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": row.name,
        "namespace": row.namespace,
        "uid": row.uid,
        "generation": row.generation,
        "resourceVersion": str(row.resource_version),
        "creationTimestamp": timestamp(row.created),
    }
    for key, column in (("labels", row.labels), ("annotations", row.annotations), ("finalizers", row.finalizers),
                        ("ownerReferences", row.owner_refs), ("managedFields", row.managed)):
        if loads(column):
            meta[key] = loads(column)
    if row.deleted:
        meta["deletionTimestamp"] = timestamp(row.deleted)
        meta["deletionGracePeriodSeconds"] = 0
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": meta,
        "spec": loads(row.spec),
        "status": loads(row.status),
    }


def timestamp(dt: datetime) -> str:
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _to_v2(s: Session) -> None:
    """v1 → v2: every job lands in `default`, holds the release finalizer, owns nothing."""
    for ddl in ("ALTER TABLE jobs ADD COLUMN namespace VARCHAR NOT NULL DEFAULT 'default'",
                f"ALTER TABLE jobs ADD COLUMN finalizers VARCHAR NOT NULL DEFAULT '[\"{RELEASE_FINALIZER}\"]'",
                "ALTER TABLE jobs ADD COLUMN owner_refs VARCHAR NOT NULL DEFAULT '[]'",
                "ALTER TABLE jobs ADD COLUMN managed VARCHAR NOT NULL DEFAULT '[]'"):
        s.connection().exec_driver_sql(ddl)


# The tables whose `job` (or `name`) column holds a job key; the work core's (controller/work/tables.py) are
# named here rather than imported: the store never depends on the work core.
KEYED_COLUMNS = (("changes", "name"), ("events", "name"), ("tasks", "job"), ("items", "job"), ("trajectories", "job"),
                 ("nodes", "job"), ("expansions", "job"), ("groups", "job"), ("batches", "job"),
                 ("batch_prompts", "job"), ("cursors", "job"), ("policies", "job"))
_JOB_COLUMNS = "namespace, name, uid, generation, resource_version, labels, annotations, spec, status, created, " \
               "deleted, finalizers, owner_refs, managed"


def _to_v3(s: Session) -> None:
    """v2 → v3: jobs are keyed by (namespace, name), so one name may live in two namespaces. The rows of a
    job outside `default` (v2 kept names unique, so the name alone identified it) take its "namespace/name" key."""
    conn = s.connection()
    tables = {r[0] for r in conn.exec_driver_sql("SELECT name FROM sqlite_master WHERE type='table'")}
    for table, column in KEYED_COLUMNS:
        if table in tables:
            conn.exec_driver_sql(
                f"UPDATE {table} SET {column} = (SELECT j.namespace || '/' || j.name FROM jobs j "
                f"WHERE j.name = {table}.{column}) WHERE {column} IN "
                f"(SELECT name FROM jobs WHERE namespace != '{DEFAULT_NAMESPACE}')")
    conn.exec_driver_sql("ALTER TABLE jobs RENAME TO jobs_v2")
    JobRow.__table__.create(conn)
    conn.exec_driver_sql(f"INSERT INTO jobs ({_JOB_COLUMNS}) SELECT {_JOB_COLUMNS} FROM jobs_v2")
    conn.exec_driver_sql("DROP TABLE jobs_v2")


def _to_v4(s: Session) -> None:
    """v3 → v4: the replicas' tables, which `leadership.py` and `shards.py` created (CREATE … IF NOT EXISTS) when they
    started, are the schema's: made here if missing (the rows of those made before are kept), `node_owners` given
    the `moves` its first form lacked, the lease row seeded."""
    conn = s.connection()
    for model in REPLICA_TABLES:
        model.__table__.create(conn, checkfirst=True)
    _add_column(conn, NodeOwnerRow.__tablename__, "moves", "BIGINT NOT NULL DEFAULT 0")
    conn.exec_driver_sql(LEASE_SEED)


def _to_v5(s: Session) -> None:
    """v4 → v5: node owners carry the id of the transaction that wrote them (0: before; a replica reads every row
    at its start and every minute, so none is missed), indexed."""
    conn = s.connection()
    _add_column(conn, NodeOwnerRow.__tablename__, "stamp", "BIGINT NOT NULL DEFAULT 0")
    conn.exec_driver_sql("CREATE INDEX IF NOT EXISTS ix_node_owners_stamp ON node_owners (stamp)")


def _to_v6(s: Session) -> None:
    """v5 → v6: the record of deleted owner rows (`replica_tables.NodeOwnerDeletionRow`); a v5 replica, which would
    delete no owner row, is refused from then on."""
    NodeOwnerDeletionRow.__table__.create(s.connection(), checkfirst=True)


def _to_v7(s: Session) -> None:
    """v6 → v7: the lease and each member name the database sessions of their holder ('' until it renews)."""
    for model in (LeaderLeaseRow, ReplicaMemberRow):
        _add_column(s.connection(), model.__tablename__, "session", "TEXT NOT NULL DEFAULT ''")


def _add_column(conn: Any, table: str, column: str, kind: str) -> None:
    """`column` added to `table` unless it has it (a table made by code older than the migration may)."""
    if column not in {c["name"] for c in inspect(conn).get_columns(table)}:
        conn.exec_driver_sql(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")


def seed(s: Session) -> None:
    """The rows a new database starts with beside its tables (the tables are `SQLModel.metadata`'s)."""
    s.connection().exec_driver_sql(LEASE_SEED)


MIGRATIONS = {1: _to_v2, 2: _to_v3, 3: _to_v4, 4: _to_v5, 5: _to_v6, 6: _to_v7}
