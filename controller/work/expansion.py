"""Dataset expansion: a job's dataset loaded once into tasks and prompt × samples queued items (restart-safe).

Called by the scheduler before a job's work is read (`batches` opens batch jobs' items by group); `queue` runs them.
The dataset is read beneath the data roots of the job's effective policy (`policy_for`; None: an admin's job).
"""
from __future__ import annotations

import json
import logging
from typing import Callable

from sqlalchemy import insert
from sqlalchemy.engine import Engine
from sqlmodel import Session

from rolloutd.agents.tasks import get_handler
from rolloutd.crds.rolloutjob import RolloutJob
from rolloutd.crds.tenancy import TenantPolicySpec

from . import tables
from .tables import ExpansionRow, ItemRow, TaskRow

log = logging.getLogger("rolloutd.scheduler")


class Expansions:
    def __init__(self, engine: Engine, clock: Callable[[], float], wake: Callable[[str], None],
                 policy_for: Callable[[RolloutJob], TenantPolicySpec | None] = lambda job: None) -> None:
        self.engine, self.clock, self.wake = engine, clock, wake
        self.policy_for = policy_for  # the job's effective tenant policy: its data roots bound what load reads
        self._rows: dict[str, ExpansionRow] = {}

    def expand(self, job: RolloutJob) -> ExpansionRow:
        """Load the dataset once and create prompt × samples items (idempotent, restart-safe)."""
        name = job.metadata.key
        cached = self._rows.get(name)
        if cached is not None and cached.uid == job.metadata.uid:
            return cached
        with Session(self.engine, expire_on_commit=False) as s:
            row = s.get(ExpansionRow, name)
            if row is not None and row.uid == job.metadata.uid:
                self._rows[name] = row
                return row
            if row is not None:  # a job re-created under the same name: start clean
                tables.purge(s, name)
                self._rows.pop(name, None)
            try:
                rows = _load(job, self.policy_for(job))
                error = "" if rows else f"dataset {job.spec.tasks.source} has no rows"
            except Exception as e:  # noqa: BLE001 - a bad dataset fails the job with its message
                rows, error = [], f"{type(e).__name__}: {e}"
            n = job.spec.samples_per_prompt
            now = self.clock()
            batch_mode = job.spec.batch_mode  # groups are opened batch by batch, on request
            # plain executemany INSERTs: an ORM object per item took minutes (and 800 MB) for 200k items
            if rows:
                s.exec(insert(TaskRow), params=[{"job": name, "prompt": p, "data": json.dumps(data)}
                                                for p, data in enumerate(rows)])
            if rows and not batch_mode:
                s.exec(insert(ItemRow), params=[{"job": name, "prompt": p, "sample": k, "queued_at": now}
                                                for p in range(len(rows)) for k in range(n)])
            row = ExpansionRow(job=name, uid=job.metadata.uid or "", prompts=len(rows),
                               total=0 if batch_mode else len(rows) * n, error=error)
            s.add(row)
            s.commit()
            s.refresh(row)
        self._rows[name] = row
        self.wake(name)
        return row

    def prompts(self, job: RolloutJob) -> int:
        """How many dataset rows (prompts) the job has."""
        return self.expand(job).prompts

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


def _load(job: RolloutJob, policy: TenantPolicySpec | None) -> list[dict]:
    """The job's rows; a tenant's read beneath its policy's data roots (a plug-in whose load takes no roots fails it)."""
    tasks, handler = job.spec.tasks, get_handler(job.spec.tasks.kind)
    if policy is None:
        return handler.load(tasks.source, tasks.limit)
    return handler.load(tasks.source, tasks.limit, roots=list(policy.data_roots))
