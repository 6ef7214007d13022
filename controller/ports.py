"""The reconcile's ports: the work tracker (the scheduler) and the progress it reads. The executor
port is `executors/base.py` (`Executor`), beside its implementations.

Consumed by the per-job reconcile (`operator/reconcile.py`) that the kopf handlers drive;
implemented by the scheduler (`work/scheduler.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from rolloutd.crds.job_status import StageCounts
from rolloutd.crds.rolloutjob import RolloutJob


@dataclass
class Progress:
    counts: StageCounts
    done: bool = False          # every rollout is finished (batch mode: the last batch is complete)
    failed: str | None = None   # a reason when the job cannot finish
    reason: str = "WorkFailed"  # the Failed condition's reason (QuotaExceeded: a quota of the job's policy)
    # the status fields the work tracker owns
    policy_version: int | str | None = None  # the trainer's last announced policy version
    reward_mean: float | None = None         # over the scored rollouts (infra failures left out)
    batch: dict[str, Any] | None = None      # batch mode: the current batch (`work/batches.Batches.status`)
    backends_down: str = ""     # why no rollout can call its model ("" while a backend is healthy)
    infra_reason: str = ""      # the last infrastructure failure's reason, once nothing is in flight


class WorkTracker(Protocol):
    async def admit(self, job: RolloutJob) -> object: ...       # the step that expands the job into work items
    async def progress(self, job: RolloutJob) -> Progress: ...
    async def registered(self, job: RolloutJob) -> int: ...   # node daemons registered and alive
    async def released(self, job: RolloutJob) -> None: ...    # its daemons were stopped: they drain
    async def forget(self, job: RolloutJob) -> None: ...
