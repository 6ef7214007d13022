"""RolloutJobs' reads and writes: get, list (selectors, paging), create, update, apply, status, delete with
finalizers, each write logged in the same transaction (the row's id is the new resourceVersion).

Called by the Kubernetes routes (`kube/`), the operator and the scheduler's job reads. The database, its
schema version (which also migrates the work tables of `controller/work/tables.py`: they live in the same
file) and the change log are `db.StoreDB`'s.
"""
from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any, Iterable

from sqlalchemy import func
from sqlmodel import Session, select

from rolloutd.crds.names import job_key, split_key
from rolloutd.crds.job_status import Phase, RolloutJobStatus
from rolloutd.crds.rolloutjob import DEFAULT_NAMESPACE, IMMUTABLE_FIELDS, RolloutJob, spec_value

from ..errors import AlreadyExists, Conflict, Invalid, NotFound
from ..selectors import fields_match, matches, parse_field_selector, parse_selector
from .db import StoreDB
from .schema import (RELEASE_FINALIZER, ChangeRow, EventRow, JobRow, Unservable, dumps, servable_wire,
                           to_resource, to_wire, utcnow)

log = logging.getLogger("rolloutd.store")

FIELD_SELECTABLE = ("metadata.name", "metadata.namespace")
# Watch history kept for resuming watchers; older resourceVersions answer 410 Expired ($ROLLOUTD_WATCH_HISTORY).
CHANGE_LOG_KEEP = 50000
OPERATOR_ANNOTATIONS = "rolloutd.io/"  # kopf's state on a job (operator/embedded.py): kept by rolloutctl apply


class Store(StoreDB):
    """RolloutJobs' reads and writes over the database and change log of `StoreDB`."""

    def __init__(self, path: Path | str, *, watch_history: int = CHANGE_LOG_KEEP, home: Path | None = None):
        """`path`: an SQLite file or a `postgresql://` URL; `watch_history`: the changes kept for resuming watches
        (the controller's `ControllerSettings`); `home`: the data dir, for files kept beside a server's store."""
        super().__init__(path, home=home)
        self._keep = watch_history
        self._trim_every = max(1, min(1000, self._keep // 2))
        self._cache: dict[str, RolloutJob] = {}
        self._epoch = 0  # bumped by every write; a read that straddles a write is not cached

    def _changed(self, key: str) -> None:
        """After a committed write: drop the cached job (a reader may have cached the old row while
        the write was in flight) and wake the watchers; on PostgreSQL tell the other processes too."""
        self._forget(key)
        self._mark(key)
        self._notify()
        self._announce(key)

    def _forget(self, key: str | None) -> None:
        with self._lock:
            self._epoch += 1
            if key is None:
                self._cache.clear()
            else:
                self._cache.pop(key, None)

    def changed_elsewhere(self, keys: Iterable[str] | None) -> None:
        """Another process wrote the jobs `keys` (None: perhaps any): their cached jobs dropped first."""
        keys = None if keys is None else list(keys)
        if keys is None:
            self._forget(None)
        else:
            for key in keys:
                self._forget(key)
        super().changed_elsewhere(keys)

    # ------------------------------------------------------------ reads

    def get(self, key: str) -> RolloutJob:
        """The job of a `job_key` ("namespace/name"; a bare name is in `default`), parsed. Shared and
        cached until the next write: treat it as read-only (`model_copy(deep=True)` before changing it)."""
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        epoch = self._epoch
        with Session(self.engine) as s:
            job = to_resource(_row(s, *reversed(split_key(key))))
        with self._lock:
            if epoch == self._epoch:  # no write happened while we read: safe to cache
                self._cache[key] = job
        return job

    def cached(self, key: str) -> RolloutJob | None:
        """`get`'s parsed job while it is cached (no write since it was read), else None: a dict lookup, for the event
        loop (a route reads a missing one with `get` in a thread)."""
        return self._cache.get(key)

    def get_wire(self, name: str, namespace: str | None = None) -> dict[str, Any]:
        with Session(self.engine) as s:
            return servable_wire(_row(s, name, namespace))

    def list_wire(self, selector: str | None = None, *, namespace: str | None = None,
                  field_selector: str | None = None) -> tuple[list[dict[str, Any]], int]:
        """Every servable job matching the selectors, ordered by (namespace, name); a row that cannot be
        served is skipped (and logged) so that one bad row never takes the whole list down."""
        sel = parse_selector(selector)
        fsel = parse_field_selector(field_selector, FIELD_SELECTABLE)
        # The rows and the resourceVersion a watch resumes from must come from one snapshot: read apart, a job
        # created between them was in neither the list nor the watch after it (kopf, starting as a job was
        # applied, never saw it). One statement is one snapshot; with no row, the version read before is safe.
        with Session(self.engine) as s:
            before = s.exec(select(func.max(ChangeRow.rv))).one() or 0
            q = select(JobRow, select(func.max(ChangeRow.rv)).scalar_subquery())
            if namespace is not None:
                q = q.where(JobRow.namespace == namespace)
            found = s.exec(q.order_by(JobRow.namespace, JobRow.name)).all()
            rows = [row for row, _ in found]
            rv = (found[0][1] or 0) if found else before
        items = []
        for row in rows:
            try:
                wire = servable_wire(row)
            except Unservable as e:
                log.error("list skips a row: %s", e.message)
                continue
            if matches(wire["metadata"].get("labels", {}), sel) and fields_match(wire, fsel):
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

    def namespaces(self) -> list[str]:
        with Session(self.engine) as s:
            used = set(s.exec(select(JobRow.namespace).distinct()).all())
        return sorted(used | {DEFAULT_NAMESPACE})

    # ------------------------------------------------------------ writes

    def _record(self, s: Session, row: JobRow, type_: str) -> dict[str, Any]:
        """Append the change-log row, stamp its id as the resource's new resourceVersion."""
        self._epoch += 1
        self._cache.pop(job_key(row.namespace, row.name), None)
        change = ChangeRow(type=type_, name=job_key(row.namespace, row.name), object="{}")
        s.add(change)
        s.flush()
        row.resource_version = change.rv
        wire = to_wire(row)
        change.object = dumps(wire)
        s.add(change)
        if change.rv % self._trim_every == 0:  # bounded history
            s.exec(ChangeRow.__table__.delete().where(ChangeRow.rv <= change.rv - self._keep))
        return wire

    def _finish(self, s: Session, row: JobRow, dry_run: bool) -> None:
        if dry_run:
            s.rollback()
            return
        key = job_key(row.namespace, row.name)
        s.commit()
        self._changed(key)

    def create(self, job: RolloutJob, *, dry_run: bool = False, managed_fields: list[dict[str, Any]] | None = None,
               uid: str | None = None) -> dict[str, Any]:
        """A new job (409 if its namespace holds one of that name already). `uid`: the operator's copy of a
        job stored elsewhere keeps that job's."""
        meta = job.metadata
        with self._lock, Session(self.engine) as s:
            if _find(s, meta.name, meta.namespace) is not None:
                raise AlreadyExists(f'rolloutjobs "{meta.name}" already exists', name=meta.name)
            row = JobRow(
                name=meta.name, namespace=meta.namespace, uid=uid or str(uuid.uuid4()), generation=1, resource_version=0,
                labels=dumps(meta.labels), annotations=dumps(meta.annotations),
                finalizers=dumps([RELEASE_FINALIZER, *(f for f in meta.finalizers if f != RELEASE_FINALIZER)]),
                owner_refs=dumps([o.wire(exclude_none=True) for o in meta.owner_references]),
                managed=dumps(managed_fields or []),
                spec=dumps(job.spec.wire()), status=dumps(RolloutJobStatus().wire()), created=utcnow(),
            )
            s.add(row)
            wire = self._record(s, row, "ADDED")
            self._finish(s, row, dry_run)
        return wire

    def update(self, job: RolloutJob, *, expect_rv: int | None = None, dry_run: bool = False,
               status_only: bool = False, managed_fields: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Replace metadata + spec (or, with `status_only`, the status) of an existing job, as a
        Kubernetes update does. 409 when `expect_rv` is stale; a no-op keeps the resourceVersion.
        The last finalizer removed from a job being deleted deletes it."""
        meta = job.metadata
        with self._lock, Session(self.engine) as s:
            row = _row(s, meta.name, meta.namespace)
            if expect_rv is not None and row.resource_version != expect_rv:
                raise Conflict(
                    f'Operation cannot be fulfilled on rolloutjobs.rolloutd.io "{meta.name}": the object has been '
                    f"modified (resourceVersion {row.resource_version}, expected {expect_rv}); "
                    "please apply your changes to the latest version and try again", name=meta.name)
            before = to_wire(row)
            if status_only:
                row.status = dumps(job.status.wire())
            else:
                self._update_main(row, job)
                if managed_fields is not None:
                    row.managed = dumps(managed_fields)
            after = to_wire(row)
            if after == before:
                s.rollback()
                return before
            if row.deleted is not None and not json.loads(row.finalizers):
                return self._delete_row(s, row, dry_run)
            wire = self._record(s, row, "MODIFIED")
            self._finish(s, row, dry_run)
        return wire

    def _update_main(self, row: JobRow, job: RolloutJob) -> None:
        meta, spec = job.metadata, job.spec.wire()
        old_spec = json.loads(row.spec)
        if old_spec != spec and _defaulted(job, old_spec) != spec:  # not just what an upgrade added as defaults
            if row.deleted is not None:
                raise Conflict(f'rolloutjobs "{row.name}" is being deleted; its spec cannot change', name=row.name)
            causes = [{"field": "spec." + ".".join(path), "reason": "FieldValueForbidden",
                       "message": "field is immutable once the job exists; delete and re-create the job"}
                      for path in IMMUTABLE_FIELDS if spec_value(old_spec, path) != spec_value(spec, path)]
            if causes:
                raise Invalid("RolloutJob is invalid: " + "; ".join(f"{c['field']}: {c['message']}" for c in causes),
                              causes=causes, name=row.name)
            row.spec = dumps(spec)
            row.generation += 1
        held = [RELEASE_FINALIZER] if RELEASE_FINALIZER in json.loads(row.finalizers) and (  # only the operator
            row.deleted is None or RELEASE_FINALIZER in meta.finalizers) else []  # drops it, once it released
        row.finalizers = dumps(held + [f for f in meta.finalizers if f != RELEASE_FINALIZER])
        row.labels = dumps(meta.labels)
        row.annotations = dumps(meta.annotations)
        row.owner_refs = dumps([o.wire(exclude_none=True) for o in meta.owner_references])

    def apply(self, job: RolloutJob, *, create_only: bool = False) -> tuple[dict[str, Any], str]:
        """rolloutctl's apply (PUT): create, or update labels/annotations/spec (the user's finalizers
        and owners are kept unless the document names some). Returns (resource, created|configured|unchanged)."""
        name = job.metadata.name
        # one writer from the read to the write: the operator's status or annotation write landing between
        # them would turn "unchanged" into "configured" and have its annotations overwritten by older ones
        with self._lock:
            with Session(self.engine) as s:
                row = _find(s, name, job.metadata.namespace)
                if row is not None:
                    deleted, rv = row.deleted, row.resource_version
                    kept = {k: v for k, v in json.loads(row.annotations).items()
                            if k.startswith(OPERATOR_ANNOTATIONS)}
            if row is None or create_only:
                return self.create(job), "created"
            if deleted is not None:
                raise Conflict(f'rolloutjobs "{name}" is being deleted; wait until it is gone', name=name)
            job.metadata.annotations = {**kept, **job.metadata.annotations}  # the operator's state (kopf) stays
            wire = self.update(job, expect_rv=_parse_rv(job.metadata.resource_version))
        return wire, "unchanged" if wire["metadata"]["resourceVersion"] == str(rv) else "configured"

    def update_status(self, key: str, status: RolloutJobStatus, *, expect_rv: int | None = None) -> dict[str, Any]:
        """Replace the status of the job `key`; with `expect_rv`, fail with Conflict if the job changed since."""
        namespace, name = split_key(key)
        with self._lock, Session(self.engine) as s:
            row = _row(s, name, namespace)
            if expect_rv is not None and row.resource_version != expect_rv:
                raise Conflict(f'rolloutjobs "{name}" changed (resourceVersion {row.resource_version}, '
                               f'expected {expect_rv})', name=name)
            new = dumps(status.wire())
            if new == row.status:
                return to_wire(row)
            row.status = new
            s.add(row)
            wire = self._record(s, row, "MODIFIED")
            s.commit()
        self._changed(key)
        return wire

    def mark_deleted(self, name: str, namespace: str | None = None, *, dry_run: bool = False) -> dict[str, Any]:
        """Deletion is two-phase: set deletionTimestamp (phase Cancelling) here; the reconciler releases
        and drops the release finalizer (`remove`); the job is gone once no finalizer is left."""
        with self._lock, Session(self.engine) as s:
            row = _row(s, name, namespace)
            if row.deleted is not None:
                return to_wire(row)
            try:
                to_resource(row)
            except Unservable as e:  # the reconciler cannot read it either: nothing to wind down
                log.error("deleting an unservable row at once: %s", e.message)
                self._delete_row(s, row, dry_run)
                return {"apiVersion": "v1", "kind": "Status", "status": "Success",
                        "details": {"kind": "rolloutjobs", "name": name}}
            row.deleted = utcnow()
            status = RolloutJobStatus.model_validate(json.loads(row.status))
            if not status.phase.terminal:
                status.phase = Phase.cancelling
            row.status = dumps(status.wire())
            s.add(row)
            wire = self._record(s, row, "MODIFIED")
            self._finish(s, row, dry_run)
        return wire

    def _delete_row(self, s: Session, row: JobRow, dry_run: bool) -> dict[str, Any]:
        wire = self._record(s, row, "DELETED")
        s.delete(row)
        for ev in s.exec(select(EventRow).where(EventRow.name == job_key(row.namespace, row.name))).all():
            s.delete(ev)
        self._finish(s, row, dry_run)
        return wire

    def remove(self, key: str) -> None:
        """The reconciler released everything: drop the release finalizer; other finalizers hold the job."""
        with self._lock, Session(self.engine) as s:
            row = _find(s, *reversed(split_key(key)))
            if row is None:
                return
            left = [f for f in json.loads(row.finalizers) if f != RELEASE_FINALIZER]
            if left and len(left) == len(json.loads(row.finalizers)):
                return
            row.finalizers = dumps(left)
            if left:
                s.add(row)
                self._record(s, row, "MODIFIED")
                self._finish(s, row, False)
            else:
                self._delete_row(s, row, False)

    def names(self) -> Iterable[str]:
        """Every job's `job_key`."""
        with Session(self.engine) as s:
            return [job_key(ns, name) for ns, name in s.exec(select(JobRow.namespace, JobRow.name)).all()]


def _find(s: Session, name: str, namespace: str | None = None) -> JobRow | None:
    """The row of `name` in `namespace` (None: `default`, as the paths without a namespace mean)."""
    return s.get(JobRow, (namespace or DEFAULT_NAMESPACE, name))


def _row(s: Session, name: str, namespace: str | None = None) -> JobRow:
    row = _find(s, name, namespace)
    if row is None:
        raise NotFound(f'rolloutjobs.rolloutd.io "{name}" not found', name=name)
    return row


def _parse_rv(rv: str | None) -> int | None:
    return int(rv) if rv and rv.isdigit() and len(rv) < 19 else None


def _defaulted(job: RolloutJob, spec: dict[str, Any]) -> dict[str, Any]:
    """A stored spec as this version reads it (the defaults it added filled in); as stored if it no longer parses."""
    try:
        return type(job.spec).model_validate(spec).wire()
    except ValueError:
        return spec
