"""The per-job reconcile logic: level-triggered, idempotent, one pass decides one job's next status.

Driven by the kopf handlers (`handlers.py`), which write the returned status and events through the
API. A pass compares the RolloutJob's desired state (spec) with what is observed (executor: node
daemons; work: rollouts per stage) and takes the next idempotent step:

    Pending → Provisioning (executor.ensure) → Running (a daemon is up) → Succeeded/Failed (`outcome`: a job
    whose rollouts mostly failed for infrastructure reasons ends Failed, never a silent Succeeded)
    deletionTimestamp set → Cancelling → `release` (executor.release) → Cancelled → finalizer dropped

Ports: the executors (`executors/base.py`: `Executor`) and the work tracker (`ports.py`: `WorkTracker`).
Next step: the executor's `ensure`/`observe`/`release`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

from rolloutd.crds.job_status import Condition, Phase, RolloutJobStatus, StageCounts
from rolloutd.crds.rolloutjob import RolloutJob

from ..executors.base import Executor, ExecutorError
from ..ports import WorkTracker


def now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def set_condition(status: RolloutJobStatus, type_: str, value: bool | None, reason: str, message: str = "") -> None:
    state = "Unknown" if value is None else ("True" if value else "False")
    cur = status.condition(type_)
    if cur is not None and cur.status == state and cur.reason == reason and cur.message == message:
        return
    changed = cur is None or cur.status != state
    new = Condition(
        type=type_, status=state, reason=reason, message=message,
        last_transition_time=now() if changed else cur.last_transition_time,
    )
    status.conditions = [c for c in status.conditions if c.type != type_] + [new]


@dataclass
class Step:
    """What one pass decided: the job's new status and the events to post (reason, message, type).
    The driver (kopf handlers, `handlers.py`) writes them through the API's status subresource."""
    status: RolloutJobStatus
    events: list[tuple[str, str, str]] = field(default_factory=list)

    def event(self, reason: str, message: str, type_: str = "Normal") -> None:
        self.events.append((reason, message, type_))


async def _stop(job: RolloutJob, executor: Executor, work: WorkTracker | None) -> None:
    """The executor stops the job's daemons (and revokes their credential); the work tracker counts none of them as
    active."""
    await executor.release(job)
    if work is not None:
        await work.released(job)


async def release(job: RolloutJob, executor: Executor | None, work: WorkTracker | None) -> Step:
    """The job is being deleted: release what the executor started, cancel its work, mark it
    Cancelled (a job that had finished keeps its phase). The driver then drops the finalizer."""
    status = job.status.model_copy(deep=True)
    if executor is not None:
        await _stop(job, executor, work)
    if work is not None:
        await work.forget(job)
    if status.phase != Phase.cancelled and not (status.phase.terminal and status.phase != Phase.cancelling):
        status.phase = Phase.cancelled
        status.completion_time = status.completion_time or now()
        set_condition(status, "Complete", False, "Cancelled", "deleted by the user")
    return Step(status)


async def reconcile(job: RolloutJob, executor: Executor | None, work: WorkTracker | None) -> Step:
    """One level-triggered pass over a live job: ensure its daemons, observe them and its work, and
    decide its phase. Idempotent: a second pass over an unchanged world returns the same status."""
    step = Step(job.status.model_copy(deep=True))
    status = step.status
    if status.phase.terminal:
        if executor is not None:
            await _stop(job, executor, work)  # idempotent: makes sure nothing is left running
        return step

    status.observed_generation = job.metadata.generation or 0
    if executor is None:
        set_condition(status, "ExecutorReady", False, "ExecutorUnavailable",
                      f"no {job.spec.executor.kind!r} executor is configured in this controller")
        return step
    set_condition(status, "ExecutorReady", True, "Configured")

    if work is not None:
        await work.admit(job)  # the dataset into work items, step by step (a read below never expands)
    progress = await work.progress(job) if work is not None else None
    if progress is not None:
        status.counts = progress.counts
        if progress.batch is not None:
            status.batch = progress.batch
        status.policy_version, status.reward_mean = progress.policy_version, progress.reward_mean
        backends(step, progress.backends_down)
        if progress.failed:
            await _stop(job, executor, work)
            return _finish(step, Phase.failed, progress.reason, progress.failed)
        if progress.done:
            await _stop(job, executor, work)
            return _finish(step, *outcome(job, progress.counts, progress.infra_reason))

    try:
        await executor.ensure(job, job.spec.executor.nodes)
        nodes = await executor.observe(job)
    except ExecutorError as e:
        set_condition(status, "Provisioned", False, e.reason, str(e))
        return _finish(step, Phase.failed, e.reason, str(e)) if e.permanent else step

    ready = await work.registered(job) if work is not None else len([n for n in nodes if n.state == "running"])
    status.nodes = ready
    if status.phase == Phase.pending:
        status.phase = Phase.provisioning
        step.event("Provisioning", f"requested {job.spec.executor.nodes} node(s) from {job.spec.executor.kind}")
    if ready:
        set_condition(status, "Provisioned", True, "NodesRunning", f"{ready}/{job.spec.executor.nodes} node daemons registered")
        if status.phase == Phase.provisioning:
            status.phase = Phase.running
            status.start_time = status.start_time or now()
            step.event("Running", f"{ready} node daemon(s) registered")
    else:
        pending = [n.reason for n in nodes if n.reason]
        set_condition(status, "Provisioned", False, "Waiting", "; ".join(pending) or "waiting for node daemons")
    return step


def backends(step: Step, down: str) -> None:
    """The BackendsReady condition, the message (kubectl's MESSAGE column) and one event per change: a job whose
    every LLM backend is down says so instead of `Running` with no reason."""
    status = step.status
    was = next((c for c in status.conditions if c.type == "BackendsReady"), None)
    if down:
        if was is None or was.status != "False":
            step.event("BackendsUnavailable", down, "Warning")
        set_condition(status, "BackendsReady", False, "BackendsUnavailable", down)
        status.message = down
    elif was is not None and was.status == "False":
        set_condition(status, "BackendsReady", True, "Healthy", "a backend answers again")
        step.event("BackendsReady", "a backend answers again")
        if status.message == was.message:
            status.message = ""


def outcome(job: RolloutJob, c: StageCounts, infra_reason: str = "") -> tuple[Phase, str, str]:
    """How a job whose every rollout has finished ends: Failed (InfraFailures) when none was scored or more than
    spec.pipeline.maxInfraFailureRatio of them failed for infrastructure reasons, else Succeeded."""
    said = f"{c.scored} scored, {c.agent_failed} agent-failed, {c.infra_failed} infra-failed, {c.cancelled} cancelled"
    ran = c.scored + c.agent_failed + c.infra_failed
    limit = job.spec.pipeline.max_infra_failure_ratio
    if c.infra_failed and (c.scored + c.agent_failed == 0 or c.infra_failed > limit * ran):
        why = f" (last: {infra_reason[:300]})" if infra_reason else ""
        return (Phase.failed, "InfraFailures", f"{c.infra_failed} of {ran} rollouts failed for infrastructure "
                f"reasons after every attempt, more than spec.pipeline.maxInfraFailureRatio {limit:g} allows{why}; {said}")
    return Phase.succeeded, "AllRolloutsFinished", said


def _finish(step: Step, phase: Phase, reason: str, message: str) -> Step:
    status = step.status
    status.phase = phase
    status.message = message
    status.completion_time = now()
    status.nodes = 0
    if phase == Phase.succeeded:
        set_condition(status, "Complete", True, reason, message)
    else:
        set_condition(status, "Complete", False, reason, message)
        set_condition(status, "Failed", True, reason, message)
    step.event(phase.value, message, "Normal" if phase == Phase.succeeded else "Warning")
    return step
