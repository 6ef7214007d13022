"""The reconcile's ports: the work tracker (the scheduler) and the progress it reads. The executor
port is `executors/base.py` (`Executor`), beside its implementations.

Consumed by the per-job reconcile (`operator/reconcile.py`) that the kopf handlers drive;
implemented by the scheduler (`work/scheduler.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rolloutd.crds.rolloutjob import RolloutJob, StageCounts


@dataclass
class Progress:
    counts: StageCounts
    done: bool = False          # every rollout is finished (batch mode: the last batch is complete)
    failed: str | None = None   # a reason when the job cannot finish
    reason: str = "WorkFailed"  # the Failed condition's reason (QuotaExceeded: a quota of the job's policy)
    extra: dict | None = None   # status fields the work tracker owns: {"batch": …, "policyVersion": …}


class WorkTracker(Protocol):
    async def admit(self, job: RolloutJob) -> object: ...       # the step that expands the job into work items
    async def progress(self, job: RolloutJob) -> Progress: ...
    async def registered(self, job: RolloutJob) -> int: ...   # node daemons registered and alive
    async def forget(self, job: RolloutJob) -> None: ...
