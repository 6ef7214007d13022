"""A RolloutJob's status (the `status` subresource): its phase, conditions, per-stage counts and batch progress.

`rolloutjob.RolloutJob.status` holds it. Next: the controller writes it (the reconciler's pass
`controller/operator/reconcile.py`, the store, the work core's counts); the API serves it to kubectl and `rolloutctl`.
"""
from __future__ import annotations

from datetime import datetime
from enum import Enum
from typing import Literal

from pydantic import Field

from .base import Model
from .names import TERMINAL_PHASES


class Phase(str, Enum):
    pending = "Pending"
    provisioning = "Provisioning"
    running = "Running"
    succeeded = "Succeeded"
    failed = "Failed"
    cancelling = "Cancelling"
    cancelled = "Cancelled"

    @property
    def terminal(self) -> bool:
        return self.value in TERMINAL_PHASES


class Condition(Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: datetime | None = None


class StageCounts(Model):
    """Rollouts per stage; `total` = prompts × samplesPerPrompt once the job is expanded. Finished ones by outcome:
    scored (a reward), agentFailed (the policy's fault, still a reward), infraFailed (ours, after every attempt: no
    reward), cancelled; `succeeded` (scored + agentFailed) and `failed` (infra or config) are the older totals."""

    total: int = 0
    queued: int = 0
    init: int = 0
    run: int = 0
    eval: int = 0
    scored: int = 0
    agent_failed: int = 0
    infra_failed: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0


class BatchStatus(Model):
    current: int = 0
    state: str = "idle"  # idle | running | complete
    counted: int = 0
    target: int = 0
    completed: int = Field(default=0, description="batches completed so far")


class RolloutJobStatus(Model):
    phase: Phase = Phase.pending
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int = 0
    counts: StageCounts = Field(default_factory=StageCounts)
    nodes: int = Field(default=0, description="node daemons registered and alive")
    start_time: datetime | None = None
    completion_time: datetime | None = None
    message: str = ""
    batch: BatchStatus | None = None
    policy_version: int | str | None = None
    reward_mean: float | None = Field(default=None, description="mean reward of the job's scored rollouts so far "
                                      "(infrastructure failures, which carry no reward, left out); null before the first")

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)
