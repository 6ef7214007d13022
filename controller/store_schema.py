"""The controller's SQLite tables, their migrations and the rendering of a job row into its API form.

Used by `store.py` (the only writer) and nothing else. SCHEMA_VERSION and MIGRATIONS move an older
database forward on open; next step: a migration for each new column, never an edited table.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlmodel import Field, Session, SQLModel

from rolloutd.crds.rolloutjob import API_VERSION, DEFAULT_NAMESPACE, KIND, RolloutJob

from .errors import ApiError

SCHEMA_VERSION = 2  # 2: namespace, finalizers, ownerReferences, managedFields
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
    name: str = Field(primary_key=True)  # unique across namespaces in this version (README: Kubernetes)
    namespace: str = Field(default=DEFAULT_NAMESPACE, sa_column_kwargs={"server_default": DEFAULT_NAMESPACE})
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
    name: str = Field(index=True)
    object: str  # JSON, the whole resource after the change


class EventRow(SQLModel, table=True):
    __tablename__ = "events"
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True)
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


MIGRATIONS = {1: _to_v2}
