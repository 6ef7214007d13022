"""The stored TenantPolicies (one per namespace, the admin's) and the one answer to "what may this job use".

The composition root (`root.py`) makes the controller's one `Policies` over its store: the TenantPolicy routes
(`kube/tenantpolicies.py`) write through it, admission at apply (`kube/admit.py`), node registration
(`work/node_registry.py`), the dataset reader and item quota (`work/expansion.py`) and the trainer's backend routes
read `effective(job)`. Reads are cached in memory and the cache is dropped on every policy write (one controller
process writes the table).
"""
from __future__ import annotations

import json
import threading
import uuid
from datetime import datetime
from typing import Any

from sqlmodel import Field, Session, SQLModel, select

from rolloutd.crds.names import API_PREFIX
from rolloutd.crds.rolloutjob import RolloutJob
from rolloutd.crds.tenancy import ADMITTED_BY, POLICY_KIND, RESTRICTED, RESTRICTED_NAME, TenantPolicySpec

from ..errors import AlreadyExists, Conflict, NotFound
from ..store import Store
from ..store.schema import dumps, timestamp, utcnow

API_VERSION = API_PREFIX.removeprefix("/apis/")
ADMIN = "admin"  # ADMITTED_BY of a job written with the admin token


class TenantPolicyRow(SQLModel, table=True):
    __tablename__ = "tenant_policies"
    name: str = Field(primary_key=True)  # the namespace it governs
    uid: str
    generation: int
    resource_version: int
    labels: str  # JSON
    annotations: str  # JSON
    spec: str  # JSON, wire form
    created: datetime | None = None


def describe(name: str | None) -> str:
    """How a refusal names the policy: "TenantPolicy team-a", or "the restricted profile"."""
    return f"{POLICY_KIND} {name}" if name else f"the {RESTRICTED_NAME} profile"


def _wire(row: TenantPolicyRow) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": row.name, "uid": row.uid, "generation": row.generation,
                            "resourceVersion": str(row.resource_version)}
    if row.created is not None:
        meta["creationTimestamp"] = timestamp(row.created)
    for key, column in (("labels", row.labels), ("annotations", row.annotations)):
        if json.loads(column):
            meta[key] = json.loads(column)
    return {"apiVersion": API_VERSION, "kind": POLICY_KIND, "metadata": meta, "spec": json.loads(row.spec)}


class Policies:
    """The TenantPolicy table of one store, with the namespace → policy answers cached."""

    def __init__(self, store: Store):
        self.engine = store.engine
        TenantPolicyRow.__table__.create(self.engine, checkfirst=True)
        self._lock = threading.RLock()
        self._cache: dict[str, tuple[TenantPolicySpec, str | None]] = {}
        self.watches: dict[str, int] = {}  # namespace → open watches of scoped tokens (`take_watch`)

    # ------------------------------------------------------------ the answers
    def for_namespace(self, namespace: str) -> tuple[TenantPolicySpec, str | None]:
        """(the namespace's policy, its name), or (RESTRICTED, None) when the admin set none."""
        hit = self._cache.get(namespace)
        if hit is not None:
            return hit
        with Session(self.engine) as s:
            row = s.get(TenantPolicyRow, namespace)
        found = (RESTRICTED, None) if row is None else (TenantPolicySpec.model_validate(json.loads(row.spec)), row.name)
        with self._lock:
            self._cache[namespace] = found
        return found

    def effective(self, job: RolloutJob) -> TenantPolicySpec | None:
        """The policy `job` is held to: None (unrestricted) when its spec was last written with the admin token
        (or before admission existed, or mirrored from a Kubernetes cluster, whose own admission governs it)."""
        return self.effective_named(job)[0]

    def effective_named(self, job: RolloutJob) -> tuple[TenantPolicySpec | None, str | None]:
        """(`effective(job)`, how a refusal names it: `describe`'s text; None when unrestricted)."""
        writer = job.metadata.annotations.get(ADMITTED_BY)
        if writer in (None, ADMIN):
            return None, None
        spec, name = self.for_namespace(job.metadata.namespace)
        return spec, describe(name)

    # ------------------------------------------------------------ open watches (quotas.watches)
    def take_watch(self, key: str, limit: int) -> int | None:
        """One more open watch for `key` (a namespace): None when taken, else how many are open (at `limit`)."""
        with self._lock:
            open_now = self.watches.get(key, 0)
            if open_now >= limit:
                return open_now
            self.watches[key] = open_now + 1
        return None

    def give_back_watch(self, key: str) -> None:
        with self._lock:
            self.watches[key] = max(0, self.watches.get(key, 1) - 1)

    # ------------------------------------------------------------ the resource
    def get_wire(self, name: str) -> dict[str, Any]:
        with Session(self.engine) as s:
            row = s.get(TenantPolicyRow, name)
            if row is None:
                raise NotFound(f'tenantpolicies.rolloutd.io "{name}" not found', name=name)
            return _wire(row)

    def list_wire(self) -> list[dict[str, Any]]:
        with Session(self.engine) as s:
            return [_wire(r) for r in s.exec(select(TenantPolicyRow).order_by(TenantPolicyRow.name)).all()]

    def put(self, name: str, spec: TenantPolicySpec, metadata: dict[str, Any], *, create_only: bool = False,
            expect_rv: int | None = None, dry_run: bool = False) -> tuple[dict[str, Any], bool]:
        """Create or replace the policy of namespace `name`: (its wire form, created)."""
        with self._lock, Session(self.engine) as s:
            row = s.get(TenantPolicyRow, name)
            created = row is None
            if row is not None and create_only:
                raise AlreadyExists(f'tenantpolicies.rolloutd.io "{name}" already exists', name=name)
            if row is not None and expect_rv is not None and expect_rv != row.resource_version:
                raise Conflict(f'Operation cannot be fulfilled on tenantpolicies.rolloutd.io "{name}": the object '
                               f"has been modified (resourceVersion {row.resource_version}, expected {expect_rv})",
                               name=name)
            if row is None:
                row = TenantPolicyRow(name=name, uid=str(uuid.uuid4()), generation=0, resource_version=0,
                                      labels="{}", annotations="{}", spec="{}", created=utcnow())
            new_spec = dumps(spec.wire())
            if new_spec != row.spec:
                row.generation += 1
            row.spec = new_spec
            row.labels = dumps(metadata.get("labels") or {})
            row.annotations = dumps(metadata.get("annotations") or {})
            row.resource_version += 1
            wire = _wire(row)
            if dry_run:
                s.rollback()
                return wire, created
            s.add(row)
            s.commit()
            self._cache.pop(name, None)
        return wire, created

    def delete(self, name: str, *, dry_run: bool = False) -> dict[str, Any]:
        with self._lock, Session(self.engine) as s:
            row = s.get(TenantPolicyRow, name)
            if row is None:
                raise NotFound(f'tenantpolicies.rolloutd.io "{name}" not found', name=name)
            wire = _wire(row)
            if not dry_run:
                s.delete(row)
                s.commit()
                self._cache.pop(name, None)
        return wire
