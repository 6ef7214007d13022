"""Durable state of the controller: RolloutJobs, their watch log and events, in SQLite (WAL).

Called by the API handlers and the reconciler; nothing else touches the database (node
daemons never do). Every mutation appends one row to the `changes` log inside the same
transaction; that row's id *is* the new resourceVersion, so resourceVersions grow
monotonically and a watcher that resumes from version N sees every later change exactly once.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from sqlalchemy import event, func
from sqlmodel import Field, Session, SQLModel, create_engine, select

from rolloutd.crds.rolloutjob import (IMMUTABLE_FIELDS, Phase, RolloutJob, RolloutJobStatus, spec_value,
                                     valid_label_key, valid_label_value)

from .errors import AlreadyExists, ApiError, BadRequest, Conflict, Gone, Invalid, NotFound

log = logging.getLogger("rolloutd.store")

SCHEMA_VERSION = 1
# Watch history kept for resuming watchers; older resourceVersions answer 410 Expired.
CHANGE_LOG_KEEP = 50_000


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


class SchemaVersionRow(SQLModel, table=True):
    __tablename__ = "schema_version"
    id: int = Field(default=1, primary_key=True)
    version: int


class JobRow(SQLModel, table=True):
    __tablename__ = "jobs"
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


def _to_resource(row: JobRow) -> RolloutJob:
    try:
        return RolloutJob.model_validate(_to_wire(row))
    except ValueError as e:  # pydantic's ValidationError is one
        raise Unservable(row.name, e) from None


def _servable_wire(row: JobRow) -> dict[str, Any]:
    """`_to_wire`, refusing what cannot be sent as JSON (NaN, Infinity) or parsed at all."""
    try:
        return _to_wire(row, loads=_strict_loads)
    except ValueError as e:  # json.JSONDecodeError is one
        raise Unservable(row.name, e) from None


def _strict_loads(text: str) -> Any:
    return json.loads(text, parse_constant=_no_constant)


def _to_wire(row: JobRow, loads=json.loads) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": row.name,
        "uid": row.uid,
        "generation": row.generation,
        "resourceVersion": str(row.resource_version),
        "creationTimestamp": _ts(row.created),
    }
    if loads(row.labels):
        meta["labels"] = loads(row.labels)
    if loads(row.annotations):
        meta["annotations"] = loads(row.annotations)
    if row.deleted:
        meta["deletionTimestamp"] = _ts(row.deleted)
    return {
        "apiVersion": "rolloutd.io/v1alpha1",
        "kind": "RolloutJob",
        "metadata": meta,
        "spec": loads(row.spec),
        "status": loads(row.status),
    }


def _ts(dt: datetime) -> str:
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


_SELECTOR_TERM = re.compile(r"^\s*(?P<neg>!)?\s*(?P<key>[^!=\s]+)\s*(?:(?P<op>==|!=|=)\s*(?P<value>[^!=\s]*))?\s*$")


def parse_selector(selector: str | None) -> list[tuple[str, str, str | None]]:
    """`a=b,c!=d,e,!f` → [(key, op, value)]; ops: =, ==, !=, exists, !exists. 400 for anything else
    (set-based `in (…)` is not supported), naming the term and why."""
    out: list[tuple[str, str, str | None]] = []
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        m = _SELECTOR_TERM.match(term)
        why = None
        if m is None or (m["neg"] and m["op"]):
            why = "expected KEY, !KEY, KEY=VALUE, KEY==VALUE or KEY!=VALUE"
        elif not valid_label_key(m["key"]):
            why = f"{m['key']!r} is not a valid label key"
        elif m["op"] and not valid_label_value(m["value"]):
            why = f"{m['value']!r} is not a valid label value (≤63 chars of [A-Za-z0-9-_.])"
        if why:
            raise BadRequest(f"invalid labelSelector term {term[:100]!r}: {why}",
                             causes=[{"field": "labelSelector", "reason": "FieldValueInvalid", "message": why}])
        if m["op"]:
            out.append((m["key"], "=" if m["op"] == "==" else m["op"], m["value"]))
        else:
            out.append((m["key"], "!exists" if m["neg"] else "exists", None))
    return out


def matches(labels: dict[str, str], selector: list[tuple[str, str, str | None]]) -> bool:
    for key, op, value in selector:
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
        if op == "exists" and key not in labels:
            return False
        if op == "!exists" and key in labels:
            return False
    return True


class Store:
    """Thread-safe; one writer at a time (a lock), readers concurrent thanks to WAL."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.engine = create_engine(
            f"sqlite:///{self.path}", connect_args={"check_same_thread": False, "timeout": 30}
        )

        @event.listens_for(self.engine, "connect")
        def _pragmas(dbapi_conn, _record):  # noqa: ANN001
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        self._lock = threading.RLock()
        self._cache: dict[str, RolloutJob] = {}
        self._epoch = 0  # bumped by every write; a read that straddles a write is not cached
        self._listeners: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._migrate()

    # ------------------------------------------------------------ schema

    def _migrate(self) -> None:
        SQLModel.metadata.create_all(self.engine)
        with Session(self.engine) as s:
            row = s.get(SchemaVersionRow, 1)
            if row is None:
                s.add(SchemaVersionRow(id=1, version=SCHEMA_VERSION))
            elif row.version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"database {self.path} has schema version {row.version}, newer than this "
                    f"rolloutd ({SCHEMA_VERSION}); upgrade rolloutd"
                )
            # Future migrations: `while row.version < SCHEMA_VERSION: MIGRATIONS[row.version](s); row.version += 1`
            s.commit()

    def schema_version(self) -> int:
        with Session(self.engine) as s:
            return s.get(SchemaVersionRow, 1).version

    # ------------------------------------------------------------ notifications

    def subscribe(self) -> asyncio.Event:
        ev = asyncio.Event()
        self._listeners.add((asyncio.get_running_loop(), ev))
        return ev

    def unsubscribe(self, ev: asyncio.Event) -> None:
        self._listeners = {(lp, e) for lp, e in self._listeners if e is not ev}

    def _changed(self, name: str) -> None:
        """After a committed write: drop the cached job (a reader may have cached the old row while
        the write was in flight) and wake the watchers."""
        with self._lock:
            self._epoch += 1
            self._cache.pop(name, None)
        self._notify()

    def _notify(self) -> None:
        for loop, ev in list(self._listeners):
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # loop closed
                self._listeners.discard((loop, ev))

    # ------------------------------------------------------------ reads

    def get(self, name: str) -> RolloutJob:
        """The job, parsed. Shared and cached until the next write: treat it as read-only
        (`model_copy(deep=True)` before changing it). The store is the database's only writer."""
        cached = self._cache.get(name)
        if cached is not None:
            return cached
        epoch = self._epoch
        with Session(self.engine) as s:
            row = s.get(JobRow, name)
            if row is None:
                raise NotFound(f'rolloutjobs "{name}" not found', name=name)
            job = _to_resource(row)
        with self._lock:
            if epoch == self._epoch:  # no write happened while we read: safe to cache
                self._cache[name] = job
        return job

    def get_wire(self, name: str) -> dict[str, Any]:
        with Session(self.engine) as s:
            row = s.get(JobRow, name)
            if row is None:
                raise NotFound(f'rolloutjobs "{name}" not found', name=name)
            return _servable_wire(row)

    def list_wire(self, selector: str | None = None) -> tuple[list[dict[str, Any]], int]:
        """Every servable job matching `selector`; a row that cannot be served is skipped (and logged)
        so that one bad row never takes the whole list down."""
        sel = parse_selector(selector)
        with Session(self.engine) as s:
            rows = s.exec(select(JobRow).order_by(JobRow.name)).all()
            rv = s.exec(select(func.max(ChangeRow.rv))).one() or 0
        items = []
        for row in rows:
            try:
                wire = _servable_wire(row)
            except Unservable as e:
                log.error("list skips a row: %s", e.message)
                continue
            if matches(wire["metadata"].get("labels", {}), sel):
                items.append(wire)
        return items, rv

    def list(self, selector: str | None = None) -> list[RolloutJob]:
        jobs = []
        for wire in self.list_wire(selector)[0]:
            try:
                jobs.append(RolloutJob.model_validate(wire))
            except ValueError as e:
                log.error("list skips rolloutjobs %r: %s", wire["metadata"]["name"], e)
        return jobs

    def current_rv(self) -> int:
        with Session(self.engine) as s:
            return s.exec(select(func.max(ChangeRow.rv))).one() or 0

    def changes_since(self, rv: int, name: str | None = None, limit: int = 500) -> list[Change]:
        with Session(self.engine) as s:
            oldest = s.exec(select(func.min(ChangeRow.rv))).one()
            if oldest is not None and rv < oldest - 1:
                raise Gone(f"resourceVersion {rv} is too old (oldest kept: {oldest}); list again and watch from there")
            q = select(ChangeRow).where(ChangeRow.rv > rv)
            if name:
                q = q.where(ChangeRow.name == name)
            rows = s.exec(q.order_by(ChangeRow.rv).limit(limit)).all()
        return [Change(r.rv, r.type, r.name, json.loads(r.object)) for r in rows]

    def events(self, name: str) -> list[dict[str, Any]]:
        with Session(self.engine) as s:
            rows = s.exec(select(EventRow).where(EventRow.name == name).order_by(EventRow.id)).all()
        return [{"time": _ts(r.time), "type": r.type, "reason": r.reason, "message": r.message} for r in rows]

    # ------------------------------------------------------------ writes

    def _record(self, s: Session, row: JobRow, type_: str) -> dict[str, Any]:
        """Append the change-log row, stamp its id as the resource's new resourceVersion."""
        self._epoch += 1
        self._cache.pop(row.name, None)
        change = ChangeRow(type=type_, name=row.name, object="{}")
        s.add(change)
        s.flush()
        row.resource_version = change.rv
        wire = _to_wire(row)
        change.object = _dumps(wire)
        s.add(change)
        if change.rv % 1000 == 0:  # bounded history
            s.exec(ChangeRow.__table__.delete().where(ChangeRow.rv <= change.rv - CHANGE_LOG_KEEP))
        return wire

    def apply(self, job: RolloutJob, *, create_only: bool = False) -> tuple[dict[str, Any], str]:
        """Server-side apply. Returns (resource, outcome) with outcome created|configured|unchanged."""
        spec = job.spec.wire()
        name = job.metadata.name
        with self._lock, Session(self.engine) as s:
            row = s.get(JobRow, name)
            if row is None:
                row = JobRow(
                    name=name,
                    uid=str(uuid.uuid4()),
                    generation=1,
                    resource_version=0,
                    labels=_dumps(job.metadata.labels),
                    annotations=_dumps(job.metadata.annotations),
                    spec=_dumps(spec),
                    status=_dumps(RolloutJobStatus().wire()),
                    created=utcnow(),
                )
                s.add(row)
                wire = self._record(s, row, "ADDED")
                s.commit()
                outcome = "created"
            else:
                if create_only:
                    raise AlreadyExists(f'rolloutjobs "{name}" already exists', name=name)
                if row.deleted is not None:
                    raise Conflict(f'rolloutjobs "{name}" is being deleted; wait until it is gone', name=name)
                old_spec = json.loads(row.spec)
                spec_changed = old_spec != spec
                meta_changed = (
                    json.loads(row.labels) != job.metadata.labels
                    or json.loads(row.annotations) != job.metadata.annotations
                )
                if not spec_changed and not meta_changed:
                    return _to_wire(row), "unchanged"
                if spec_changed:
                    causes = [
                        {
                            "field": "spec." + ".".join(path),
                            "reason": "FieldValueForbidden",
                            "message": "field is immutable once the job exists; delete and re-create the job",
                        }
                        for path in IMMUTABLE_FIELDS
                        if spec_value(old_spec, path) != spec_value(spec, path)
                    ]
                    if causes:
                        raise Invalid(
                            "RolloutJob is invalid: " + "; ".join(f"{c['field']}: {c['message']}" for c in causes),
                            causes=causes,
                            name=name,
                        )
                    row.spec = _dumps(spec)
                    row.generation += 1
                row.labels = _dumps(job.metadata.labels)
                row.annotations = _dumps(job.metadata.annotations)
                s.add(row)
                wire = self._record(s, row, "MODIFIED")
                s.commit()
                outcome = "configured"
        self._changed(name)
        return wire, outcome

    def update_status(
        self, name: str, status: RolloutJobStatus, *, expect_rv: int | None = None
    ) -> dict[str, Any]:
        """Replace the status; with `expect_rv`, fail with Conflict if the job changed since."""
        with self._lock, Session(self.engine) as s:
            row = s.get(JobRow, name)
            if row is None:
                raise NotFound(f'rolloutjobs "{name}" not found', name=name)
            if expect_rv is not None and row.resource_version != expect_rv:
                raise Conflict(
                    f'rolloutjobs "{name}" changed (resourceVersion {row.resource_version}, expected {expect_rv})',
                    name=name,
                )
            new = _dumps(status.wire())
            if new == row.status:
                return _to_wire(row)
            row.status = new
            s.add(row)
            wire = self._record(s, row, "MODIFIED")
            s.commit()
        self._changed(name)
        return wire

    def mark_deleted(self, name: str) -> dict[str, Any]:
        """Deletion is two-phase: mark (phase Cancelling) here, the reconciler releases and removes."""
        with self._lock, Session(self.engine) as s:
            row = s.get(JobRow, name)
            if row is None:
                raise NotFound(f'rolloutjobs "{name}" not found', name=name)
            if row.deleted is not None:
                return _to_wire(row)
            try:
                _to_resource(row)
            except Unservable as e:  # the reconciler cannot read it either: nothing to wind down
                log.error("deleting an unservable row at once: %s", e.message)
                self._record(s, row, "DELETED")
                s.delete(row)
                s.commit()
                self._changed(name)
                return {"apiVersion": "v1", "kind": "Status", "status": "Success",
                        "details": {"kind": "rolloutjobs", "name": name}}
            row.deleted = utcnow()
            status = RolloutJobStatus.model_validate(json.loads(row.status))
            if not status.phase.terminal:
                status.phase = Phase.cancelling
            row.status = _dumps(status.wire())
            s.add(row)
            wire = self._record(s, row, "MODIFIED")
            s.commit()
        self._changed(name)
        return wire

    def remove(self, name: str) -> None:
        with self._lock, Session(self.engine) as s:
            row = s.get(JobRow, name)
            if row is None:
                return
            self._record(s, row, "DELETED")
            s.delete(row)
            for ev in s.exec(select(EventRow).where(EventRow.name == name)).all():
                s.delete(ev)
            s.commit()
        self._changed(name)

    def add_event(self, name: str, reason: str, message: str, type_: str = "Normal") -> None:
        with self._lock, Session(self.engine) as s:
            s.add(EventRow(name=name, time=utcnow(), type=type_, reason=reason, message=message))
            s.commit()

    def names(self) -> Iterable[str]:
        with Session(self.engine) as s:
            return list(s.exec(select(JobRow.name)).all())
