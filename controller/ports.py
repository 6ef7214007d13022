"""The reconcile's ports: the work tracker (the scheduler), the store calls it makes, and the progress
it reads. The executor port is `executors/base.py` (`Executor`), beside its implementations.

Consumed by the reconcile loop (`reconciler.py`), which any other driver of RolloutJobs (kopf
handlers) can replace whole over these same ports; implemented by the scheduler and `store.py`.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from rolloutd.crds.rolloutjob import RolloutJob, RolloutJobStatus, StageCounts


@dataclass
class Progress:
    counts: StageCounts
    done: bool = False          # every rollout is finished (batch mode: the last batch is complete)
    failed: str | None = None   # a reason when the job cannot finish
    extra: dict | None = None   # status fields the work tracker owns: {"batch": …, "policyVersion": …}


class WorkTracker(Protocol):
    async def progress(self, job: RolloutJob) -> Progress: ...
    async def registered(self, job: RolloutJob) -> int: ...   # node daemons registered and alive
    async def forget(self, job: RolloutJob) -> None: ...


class JobStore(Protocol):
    """The store calls the reconcile makes (blocking: it runs them in a thread)."""

    def subscribe(self) -> asyncio.Event: ...                    # set on every change
    def unsubscribe(self, ev: asyncio.Event) -> None: ...
    def current_rv(self) -> int: ...
    def changes_since(self, rv: int, name: str | None = None, limit: int = 500) -> Sequence[Any]: ...  # .name .type .rv
    def get(self, name: str) -> RolloutJob: ...
    def list(self) -> list[RolloutJob]: ...
    def update_status(self, name: str, status: RolloutJobStatus, *, expect_rv: int | None = None) -> Any: ...
    def remove(self, name: str) -> None: ...
    def add_event(self, name: str, reason: str, message: str, type_: str = "Normal") -> None: ...
