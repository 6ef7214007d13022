"""Dataset expansion: a job's dataset loaded into tasks and prompt × samples queued items, step by step.

The step "admit" (`Expansions.admit`, driven by `Scheduler.admit` from the reconcile) starts a job's expansion —
the dataset read once, the item quota of the job's policy checked — or continues it by one short transaction
of at most `CHUNK` rows, so a job of half a million items never holds the event loop or the database for
long. Reads (`row`, `prompts`) never expand. Restart-safe: `ExpansionRow.pending` says where to go on.
The dataset is read beneath the data roots of the job's effective policy (`policy_for`; None: an admin's job).
`batches` opens batch jobs' items by group; `queue` runs them. Next step: `queue.py`.
"""
from __future__ import annotations

import json
import logging
from typing import Callable

from sqlalchemy.engine import Engine
from sqlmodel import Session

from rolloutd.agents.tasks import get_handler
from rolloutd.crds.rolloutjob import RolloutJob
from rolloutd.crds.tenancy import RESTRICTED, TenantPolicySpec

from ..dialects import insert_rows, raw
from . import tables
from .states import ItemState
from .tables import ExpansionRow, ItemRow, TaskRow

log = logging.getLogger("rolloutd.scheduler")

CHUNK = 2048  # rows (items, or a batch job's tasks) one step writes: one short transaction
QUOTA_EXCEEDED = "QuotaExceeded"
TASKS, ITEMS = TaskRow.__table__, ItemRow.__table__
_ITEM_COLUMNS = ("job", "prompt", "sample", "state", "attempt", "holds_backend", "queued_at", "last_error")
PolicyFor = Callable[[RolloutJob], "TenantPolicySpec | None"]


def _policy_name(job: RolloutJob, policy: TenantPolicySpec) -> str:
    return "the restricted profile" if policy is RESTRICTED else f'the TenantPolicy "{job.metadata.namespace}"'


class Expansions:
    def __init__(self, engine: Engine, clock: Callable[[], float], wake: Callable[[str], None],
                 policy_for: PolicyFor = lambda job: None) -> None:
        self.engine, self.clock, self.wake, self.policy_for = engine, clock, wake, policy_for
        self._rows: dict[str, ExpansionRow] = {}
        self._data: dict[str, tuple[str, list[dict]]] = {}  # key → (uid, dataset rows) while being expanded

    # ------------------------------------------------------------ reads

    def row(self, job: RolloutJob) -> ExpansionRow | None:
        """The job's expansion as it stands (None: not started, or a deleted job's of the same name)."""
        key, uid = job.metadata.key, job.metadata.uid or ""
        cached = self._rows.get(key)
        if cached is not None and cached.uid == uid:
            return cached
        with Session(self.engine, expire_on_commit=False) as s:
            row = s.get(ExpansionRow, key)
        if row is None or row.uid != uid:
            return None
        self._rows[key] = row
        return row

    def prompts(self, job: RolloutJob) -> int:
        """How many dataset rows (prompts) the job has; 0 until its expansion is complete."""
        row = self.row(job)
        return row.prompts if row is not None and not row.pending else 0

    # ------------------------------------------------------------ the step "admit"

    def admit(self, job: RolloutJob, wake: bool = True) -> ExpansionRow:
        """Start the job's expansion, or continue it by one step of at most CHUNK rows (a no-op once it is
        complete or failed). Returns the row; `pending` 0 means every item is queued. Safe in a worker thread
        with `wake=False` (one step of a job at a time; the caller wakes the job's waiters on its loop)."""
        row = self.row(job)
        if row is None:
            row = self._start(job)
        elif row.pending and not row.error:
            row = self._step(job, row)
        else:
            return row
        if wake:
            self.wake(job.metadata.key)
        return row

    def expand(self, job: RolloutJob) -> ExpansionRow:
        """Every step at once (tests, tools and the batch server; the reconciler admits step by step)."""
        row = self.admit(job)
        while row.pending and not row.error:
            row = self.admit(job)
        return row

    def _load(self, job: RolloutJob, limit: int | None) -> tuple[list[dict], str]:
        """The job's rows: a tenant's read beneath its policy's data roots (a plug-in whose load takes no roots
        fails such a job), an admin's as the handler reads it."""
        policy, source = self.policy_for(job), job.spec.tasks.source
        try:
            handler = get_handler(job.spec.tasks.kind)
        except Exception as e:  # noqa: BLE001 - a kind unknown here (a plug-in since removed) fails the job once
            return [], f"spec.tasks.kind: {e}"
        try:
            if policy is None:
                rows = handler.load(source, limit)
            else:
                rows = handler.load(source, limit, roots=list(policy.data_roots))
            return rows, "" if rows else f"spec.tasks.source: dataset {source} has no rows"
        except Exception as e:  # noqa: BLE001 - a bad dataset fails the job with its message, naming the field once
            named = str(e).startswith("spec.tasks.")
            return [], f"{'' if named else 'spec.tasks.source: '}{type(e).__name__}: {e}"

    def _start(self, job: RolloutJob) -> ExpansionRow:
        key, n = job.metadata.key, job.spec.samples_per_prompt
        with Session(self.engine, expire_on_commit=False) as s:
            if s.get(ExpansionRow, key) is not None:  # a job re-created under the same name: start clean
                tables.purge(s, key)
                s.commit()
        policy = self.policy_for(job)
        limit = job.spec.tasks.limit
        if policy is not None:  # read no more prompts than the quota holds, and one more to see it overflow
            fit = policy.quotas.items_per_job // n + (0 if job.spec.batch_mode else 1)  # batches: counted as opened
            limit = fit if limit is None else min(limit, fit)
        rows, error = self._load(job, limit)
        reason = "WorkFailed" if error else ""
        if policy is not None and not job.spec.batch_mode and len(rows) * n > policy.quotas.items_per_job:
            quota = policy.quotas.items_per_job
            more = "at least " if len(rows) == limit and limit != job.spec.tasks.limit else ""
            error = (f"spec.tasks: {more}{len(rows)} prompts × spec.samplesPerPrompt {n} = {more}{len(rows) * n} "
                     f"rollouts, over the item quota quotas.itemsPerJob ({quota}) of {_policy_name(job, policy)}")
            reason, rows = QUOTA_EXCEEDED, []
        total = 0 if job.spec.batch_mode else len(rows) * n  # a batch job's groups are opened on request
        row = ExpansionRow(job=key, uid=job.metadata.uid or "", prompts=len(rows), total=total,
                           pending=len(rows), error=error, reason=reason)
        with Session(self.engine, expire_on_commit=False) as s:
            s.add(row)
            s.commit()
            s.refresh(row)
        self._rows[key] = row
        if rows:
            self._data[key] = (row.uid, rows)
        if error:
            log.error("job %s fails: %s", key, error)
        return row

    def _step(self, job: RolloutJob, row: ExpansionRow) -> ExpansionRow:
        key, n = job.metadata.key, job.spec.samples_per_prompt
        data = self._data.get(key)
        if data is None or data[0] != row.uid:  # a restarted controller goes on where it stopped
            rows, error = self._load(job, row.prompts)
            if error or len(rows) != row.prompts:
                return self._failed(row, error or f"dataset {job.spec.tasks.source} changed while it was expanded")
            data = self._data[key] = (row.uid, rows)
        rows = data[1]
        first = row.prompts - row.pending
        last = min(row.prompts, first + (CHUNK if job.spec.batch_mode else max(1, CHUNK // n)))
        now = self.clock()
        with Session(self.engine, expire_on_commit=False) as s:
            # plain rows: an ORM object per item took minutes (and 800 MB) for 200k items
            db = raw(s.connection())
            insert_rows(db, TASKS, ("job", "prompt", "data"),
                        [(key, p, json.dumps(rows[p])) for p in range(first, last)])
            if not job.spec.batch_mode:
                insert_rows(db, ITEMS, _ITEM_COLUMNS, [(key, p, k, ItemState.queued.value, 0, False, now, "")
                                                       for p in range(first, last) for k in range(n)])
            fresh = s.get(ExpansionRow, key)  # a new object: readers on the loop keep theirs until the swap
            fresh.pending = row.prompts - last
            s.add(fresh)
            s.commit()
        self._rows[key] = fresh
        if not fresh.pending:
            self._data.pop(key, None)
        return fresh

    def _failed(self, row: ExpansionRow, error: str) -> ExpansionRow:
        with Session(self.engine, expire_on_commit=False) as s:
            fresh = s.get(ExpansionRow, row.job)
            fresh.error, fresh.reason = error, fresh.reason or "WorkFailed"
            s.add(fresh)
            s.commit()
        self._rows[row.job] = fresh
        log.error("job %s fails: %s", row.job, error)
        return fresh

    # ------------------------------------------------------------ failures and deletion

    def fail(self, s: Session, name: str, reason: str) -> None:
        """Record a configuration error as the job's failure (the first one wins)."""
        row = s.get(ExpansionRow, name)
        if row is not None and not row.error:
            row.error = reason
            s.add(row)
            self._rows[name] = row
        log.error("job %s fails: %s", name, reason)

    def forget(self, name: str) -> None:
        self._rows.pop(name, None)
        self._data.pop(name, None)
