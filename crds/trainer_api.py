"""Wire models of the trainer API's answers: a batch, the prompt groups, the job's policy versions, a policy
announce, the job's backends.

`controller/http/trainer.py` answers with them (each answer checked against its model, so the document and the
answer cannot drift apart) and `controller/http/openapi.py` documents them; the client (`rolloutd.client`) hands
trainers the same JSON as dicts. Next step: the routes in controller/http/trainer.py.
"""
from __future__ import annotations

from typing import Any

from pydantic import ConfigDict

from .base import Model


class BackendView(Model):
    """One of the job's LLM backends as the controller sees it now (the web UI shows the same view)."""
    url: str
    healthy: bool
    reason: str  # why it is not healthy ("" when it is; "down" for a caller who may not see the reason)
    inflight: int  # rollouts of every job in flight on it
    pinned_to_job: int  # this job's tasks pinned to it (sticky routing)
    admission_cap: int  # the episodes it admits at once for this job


class BackendList(Model):
    items: list[BackendView]


class Staleness(Model):
    """What the staleness bound (`spec.policy.maxStaleness`) did: rollouts cancelled and groups swept at announces,
    groups the capacity gate held back, results that came too old and were run again."""
    cancelled_rollouts: int = 0
    swept_groups: int = 0
    gated: int = 0
    rerun: int = 0


class JobPolicy(Model):
    """The job's policy versions: the one it runs, every one it ran, whether new LLM calls are held."""
    version: int | str | None
    history: list[int | str]
    paused: bool
    staleness: Staleness


class BackendUpdate(Model):
    """One backend's part of an announce: whether it reloaded, and the error that kept it on its old weights."""
    url: str
    reloaded: bool
    error: str | None
    reload_seconds: float | None = None
    reset_seconds: float | None = None
    reset_tries: int | None = None


class PolicyAnnounce(Model):
    """The answer to an announce, once every backend runs the new version or failed to load it."""
    version: int | str
    mode: str  # the job's spec.policy.updateMode: drain, keep or abort
    paused_seconds: float  # from the announce to its answer
    engines_paused_seconds: float  # from the first engine's pause to the last one's resume
    steps: dict[str, float | dict[str, float]]  # seconds from the announce to each step (per node where it is one)
    drained: bool  # every daemon answered in time
    backends: list[BackendUpdate]
    staleness: Staleness | None = None  # the sweep, under a staleness bound


class BatchGroup(Model):
    """One group of a batch: a prompt's samples (trajectories, as `GET …/trajectories` gives them)."""
    model_config = ConfigDict(allow_inf_nan=True)  # a reward is the verifier's float (trajectory.py)
    group: int
    prompt: int
    state: str
    rewards: list[float]
    samples: list[dict[str, Any]]


class PromptGroup(Model):
    """`GET …/groups`: one prompt's delivered samples so far, and whether all of `spec.samplesPerPrompt` are in."""
    model_config = ConfigDict(allow_inf_nan=True)
    prompt: int
    samples: list[dict[str, Any]]
    rewards: list[float | None]  # None: a sample with no reward (its rollout failed)
    complete: bool


class PromptGroups(Model):
    items: list[PromptGroup]


class BatchOpened(Model):
    """A batch as the trainer sees it: its state, what is counted, what the early termination saved."""
    batch: int
    state: str  # filling, complete or failed
    target: int
    counted: int
    prompts: list[int] | None  # the dataset indices the trainer named (None: the job's own order)
    opened_groups: int
    cancelled_rollouts: int
    never_started: int
    saved_tokens_estimate: int
    seconds_to_fill: float | None
    policy_versions: list[str]


class Batch(BatchOpened):
    """`GET …/batches/{k}`: the batch with its counted groups (`all=true`: every group)."""
    groups: list[BatchGroup]

