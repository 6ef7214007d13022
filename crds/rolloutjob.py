"""The RolloutJob resource (apiVersion rolloutd.io/v1alpha1): metadata and spec (its status is `job_status.py`).

The user's declaration of what they want, reconciled by the controller into allocations,
daemons, queued work and results. Validated here once (unknown fields rejected), used by
the API (`rolloutd.controller.api`), the reconciler, the CLI and the CRD generator (`crd.py`).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from .agent_spec import (LLM_FREE_AGENTS, AgentKind, AgentSpec, BackendSpec, LLMSpec,  # noqa: F401 - re-exported
                         SamplingSpec, Tool)
from .base import Model
from .mounts import check_mount_paths
from .executor import ExecutorSpec
from .job_status import RolloutJobStatus
from .k8s_names import (valid_label_key, valid_label_value, validate_annotations, validate_name,
                        validate_name_prefix)
from .names import DEFAULT_NAMESPACE, GROUP, VERSION, job_key
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RolloutJob"
# the most a sandbox's size may be: a size in MB times 2^20 must fit the int64 of an rlimit, a cgroup or tmpfs bound
# (memoryMB 9·10^12 passed the schema, and then no sandbox of the job could start bash); pids.max takes no more
# processes than the kernel's PID_MAX_LIMIT
MAX_MB = 1 << 24  # 16 TiB
MAX_PROCESSES = 1 << 22
# a batch's groups: times samplesPerPrompt (≤ 2^10) a batch's rollouts stay within a 32-bit column (PostgreSQL's
# integer), as do DAPO's in-flight groups (2 × targetGroups by default); a batch's number is such a column too
MAX_GROUPS = 1 << 20
MAX_BATCHES = (1 << 31) - 1

# ---------------------------------------------------------------- metadata


class OwnerReference(Model):
    api_version: str = Field(alias="apiVersion")
    kind: str
    name: str
    uid: str
    controller: bool | None = None
    block_owner_deletion: bool | None = None


class ObjectMeta(Model):
    name: str
    generate_name: str | None = None  # a create without a name is named from it (kube/rolloutjobs.py); not stored
    namespace: str = DEFAULT_NAMESPACE
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    finalizers: list[str] = Field(default_factory=list)
    owner_references: list[OwnerReference] = Field(default_factory=list)
    # Server-set; accepted on input (so `get -o yaml | apply -f -` works) but never trusted
    # (resourceVersion, when sent on an update, is the precondition of optimistic concurrency).
    uid: str | None = None
    generation: int | None = None
    resource_version: str | None = None
    creation_timestamp: datetime | None = None
    deletion_timestamp: datetime | None = None
    deletion_grace_period_seconds: int | None = None
    managed_fields: list[dict[str, Any]] = Field(default_factory=list)

    @property
    def key(self) -> str:
        """The controller's identity of the job (`names.job_key`): work rows, executors, node env."""
        return job_key(self.namespace, self.name)

    @field_validator("name", "namespace")
    @classmethod
    def _name(cls, v: str) -> str:
        return validate_name(v)

    @field_validator("generate_name")
    @classmethod
    def _prefix(cls, v: str | None) -> str | None:
        return None if v is None else validate_name_prefix(v)

    @field_validator("annotations")
    @classmethod
    def _annotations(cls, v: dict[str, str]) -> dict[str, str]:
        return validate_annotations(v)

    @field_validator("finalizers")
    @classmethod
    def _finalizers(cls, v: list[str]) -> list[str]:
        for f in v:
            if not valid_label_key(f):
                raise ValueError(f"finalizer {f!r} must be a qualified name such as 'example.com/hold'")
        return list(dict.fromkeys(v))

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not valid_label_key(key):
                raise ValueError(f"label key {key!r} is not a valid label key")
            if not valid_label_value(value):
                raise ValueError(f"label {key}={value!r}: value must be ≤63 chars of [A-Za-z0-9-_.]")
        return v


# ---------------------------------------------------------------- spec


class TasksSpec(Model):
    """What the rollouts are about: a task handler and its dataset."""

    kind: str = Field(description="math | stem | code | swe | a plug-in name (entry point group rolloutd.tasks)",
                      pattern=r"^[a-z][a-z0-9_-]*$")
    source: str = Field(description="JSON-lines dataset (path on the controller's filesystem)")
    limit: int | None = Field(default=None, ge=1, description="use only the first N prompts")
    options: dict[str, Any] = Field(
        default_factory=dict, max_length=64,
        description="the task handler's options (math: requireBoxed), checked at apply against the handler; "
                    "each a string, number or boolean")

    @field_validator("options")
    @classmethod
    def _scalar_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        bad = [k for k, v in options.items() if not isinstance(v, (str, int, float, bool)) or v is None]
        if bad:
            raise ValueError(f"{', '.join(bad)}: an option is a string, a number or a boolean")
        return options


class SandboxLimits(Model):
    """What one sandbox may use."""

    memory_mb: int = Field(default=1024, ge=16, le=MAX_MB, alias="memoryMB",
                           description="address-space rlimit per process and, where possible, a cgroup memory limit")
    processes: int = Field(default=256, ge=8, le=MAX_PROCESSES,
                           description="process limit (cgroup pids.max where possible; RLIMIT_NPROC for non-root)")
    file_size_mb: int = Field(default=1024, ge=1, le=MAX_MB, alias="fileSizeMB",
                              description="largest file a process may write (RLIMIT_FSIZE)")
    wall_seconds: int = Field(default=600, ge=1, description="the sandbox is killed this long after it starts")
    tmp_mb: int = Field(default=1024, ge=1, le=MAX_MB, alias="tmpMB",
                        description="size of the private /tmp and /dev/shm (tmpfs)")
    cpus: float | None = Field(default=1.0, gt=0, le=1024,
                               description="CPU bound in cores (a cgroup cpu quota) where the node may create cgroups "
                                           "(v2 delegated, or v1); elsewhere skipped, the reason in the sandbox's limits")
    workspace_mb: int | None = Field(default=4096, ge=1, le=MAX_MB, alias="workspaceMB",
                                     description="size bound of /workspace (a tmpfs of this size, in memory) under a "
                                                 "root node; elsewhere skipped, the reason in the sandbox's limits. "
                                                 "null: no bound")


class MountSpec(Model):
    host_path: str = Field(description="absolute host path; secrets and rolloutd's data dirs are refused")
    path: str | None = Field(default=None, description="where it appears in the sandbox (default: hostPath)")
    read_only: bool = Field(default=True, description="false: the sandbox may write it")

    @model_validator(mode="after")
    def _policy(self) -> "MountSpec":
        check_mount_paths(self.host_path, self.inside)
        return self

    @property
    def inside(self) -> str:
        return self.path or self.host_path


# The sandbox runtimes a spec may name: the one list of their kinds (the CRD's enum, the tenant policy's
# `runtimes`, `rolloutd sandbox exec --runtime`). Each is registered under the same name in the
# `rolloutd.sandbox.runtimes` entry-point group (pyproject.toml); tests/sandbox/runtimes/test_registry.py keeps
# the two equal.
RuntimeKind = Literal["bwrap", "apptainer", "process"]


# The one sandbox spec: a job's `spec.sandbox` is also what `rolloutd.sandbox` runtimes create (its
# limits enforced as sandbox/README.md "Isolation and limits" says).
class SandboxSpec(Model):
    """Where a rollout's commands run: one sandbox per rollout."""

    runtime: RuntimeKind = Field(
        default="bwrap", description="bwrap (rootless, the default), apptainer (where installed), process (development "
        "only: no isolation)")
    image: str = Field(default="host", description="host | a rootfs directory | an .sif file")
    network: bool = Field(default=False, description="give sandboxes an outbound network (bwrap): public addresses "
                          "only, the node's own, private, link-local and metadata addresses refused")
    user: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]*)?$",
                             description="run sandboxed code as this non-root user of the image (name or uid[:group], "
                                         "from the rootfs image's /etc/passwd; HOME is its home); default: the "
                                         "runtime's unprivileged user. harbor tasks set it from the task")
    verifier_network: bool = Field(default=False, description="consent: a harbor task that allows the internet "
                                   "([environment] allow_internet, Harbor's default) gets an egress proxy in EVAL (its "
                                   "verifier), never while the agent runs; it reaches public destinations only "
                                   "(loopback, private, link-local and metadata addresses are refused)")
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    env: dict[str, str] = Field(default_factory=dict, description="added to the sandbox's default environment")
    mounts: list[MountSpec] = Field(default_factory=list, max_length=32,
                                    description="host paths a task needs (read-only unless readOnly: false)")
    warm: int = Field(default=2, ge=0, le=64,
                      description="sandboxes each node keeps started ahead of need, at least; after a burst of "
                                  "INITs a node keeps as many as the largest burst of the last minute (at most 64, "
                                  "and never more sandboxes alive than init + run + eval + warm) (0: start one per "
                                  "rollout)")

    @model_validator(mode="after")
    def _network_needs_bwrap(self) -> "SandboxSpec":
        if self.network and self.runtime == "apptainer":
            raise ValueError("network: true needs the bwrap runtime (apptainer would give the sandbox the node's "
                             "own network, its loopback included)")
        return self


# A pool's workers per node at most: a sandbox each (INIT, EVAL) or an agent loop (RUN); a node's calls name at most
# `crds.node.MAX_ATTEMPTS_PER_CALL` attempts, which the three pools together stay under
MAX_WORKERS = 4096


class WorkersPerNode(Model):
    """Pool sizes per node daemon: rollouts in each stage at once."""

    init: int = Field(default=8, ge=1, le=MAX_WORKERS, description="INIT workers: sandboxes being created and staged")
    run: int = Field(default=32, ge=1, le=MAX_WORKERS, description="RUN workers: agent loops talking to the model")
    eval: int = Field(default=8, ge=1, le=MAX_WORKERS, description="EVAL workers: verifiers scoring finished rollouts")


class PipelineSpec(Model):
    """How the node daemons run rollouts: the INIT, RUN and EVAL pools, attempts and leases."""

    workers_per_node: WorkersPerNode = Field(default_factory=WorkersPerNode, description="the pools' sizes")
    max_attempts: int = Field(default=3, ge=1, description="attempts per rollout for infrastructure failures")
    lease_seconds: float = Field(default=30.0, ge=1.0, le=3600.0,
                                 description="a lease not extended by a heartbeat for this long goes back to the queue; "
                                 "a node daemon that has not reached the controller for 20 × this long plus 60 s (its "
                                 "start) exits (a controller away up to 10 × this long loses nothing)")
    max_infra_failure_ratio: float = Field(default=0.5, ge=0.0, le=1.0, description="the job ends Failed "
                                           "(InfraFailures) when more than this share of its finished rollouts failed "
                                           "for infrastructure reasons, and always when none was scored")


class DapoSpec(Model):
    """DAPO's dynamic sampling: keep sampling until `targetGroups` informative groups are scored, then cancel the rest on the daemons."""

    enabled: bool = Field(default=False, description="serve DAPO batches (a batch job)")
    target_groups: int = Field(default=16, ge=1, le=MAX_GROUPS, description="informative groups per batch")
    max_in_flight_groups: int | None = Field(default=None, ge=1, le=2 * MAX_GROUPS, description="groups sampled at "
                                             "once (default: 2 × targetGroups)")
    filter: Literal["zeroVariance", "band"] = Field(default="zeroVariance", description="zeroVariance: a group "
                                                    "whose rewards all agree is not informative; band: see band")
    band: tuple[float, float] | None = Field(default=None, description="[low, high] mean-reward band for filter: band")
    carry_over: bool = Field(default=False, description="groups still running when a batch fills count toward "
                                                       "the next one instead of being cancelled")


class BatchesSpec(Model):
    """Serve batch after batch (a trainer asks for each): a batch = `groups` complete groups."""

    groups: int = Field(ge=1, le=MAX_GROUPS, description="groups (prompts × samplesPerPrompt) per batch")
    count: int | None = Field(default=None, ge=1, le=MAX_BATCHES, description="stop after this many batches (null: "
                              "until deleted)")
    max_in_flight_groups: int | None = Field(default=None, ge=1, le=MAX_GROUPS, description="groups sampled at once "
                                             "(default: the batch's groups)")
    carry_over: bool = Field(default=False, description="unfinished groups continue into the next batch")


class PolicySpec(Model):
    """Policy versions: what happens while the trainer publishes new weights."""

    update_mode: Literal["drain", "keep", "abort"] = Field(default="drain", description=(
        "how a weight update treats generations in flight: drain (hold new LLM calls, wait for the running ones to "
        "end, then load), keep (pause the engines with their requests in place, load, resume: requests continue on "
        "the new weights), abort (abort them, keep their tokens, continue each on the new weights); keep and abort "
        "never wait for a generation and record where in each turn the version changed (versionSpans)"))
    pause_on_update: bool = Field(default=True, description="drain mode: hold new LLM calls and drain in-flight ones "
                                                            "while the weights change (false: neither)")
    max_staleness: int | None = Field(default=None, ge=0,
                                      description="re-run a sample generated more than this many versions ago; at "
                                      "each announce, cancel and re-run rollouts leased more than this many versions "
                                      "before it, and take such groups out of the running batch")


class TimeoutsSpec(Model):
    """Deadlines per stage; a stage past its deadline is an infrastructure failure of that attempt."""

    init_seconds: float = Field(default=120, gt=0, description="INIT: sandbox created and task staged")
    run_seconds: float = Field(default=900, gt=0, description="RUN: the whole agent loop")
    eval_seconds: float = Field(default=600, gt=0, description="EVAL: scoring")
    action_seconds: float = Field(default=60, gt=0, description="one tool call in the sandbox")


class RolloutJobSpec(Model):
    """What a RolloutJob asks for."""

    tasks: TasksSpec
    samples_per_prompt: int = Field(default=1, ge=1, le=1024, description="rollouts per prompt (one GRPO group)")
    priority: int = Field(default=1, ge=1, le=1000, description="weight of this job's share of the backends it "
                          "shares with other jobs (weighted fair queueing of their episode admissions)")
    agent: AgentSpec = Field(default_factory=AgentSpec)
    llm: LLMSpec = Field(default_factory=LLMSpec, validate_default=True)
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec)
    executor: ExecutorSpec = Field(default_factory=ExecutorSpec)
    pipeline: PipelineSpec = Field(default_factory=PipelineSpec)
    dapo: DapoSpec = Field(default_factory=DapoSpec)
    batches: BatchesSpec | None = None
    policy: PolicySpec = Field(default_factory=PolicySpec)
    timeouts: TimeoutsSpec = Field(default_factory=TimeoutsSpec)

    @field_validator("llm")
    @classmethod
    def _llm_needed(cls, llm: LLMSpec, info: ValidationInfo) -> LLMSpec:
        agent = info.data.get("agent")
        kind = agent.kind if agent is not None else "loop"
        if llm.tokenizer is None and kind not in LLM_FREE_AGENTS:
            raise ValueError(f"llm.tokenizer is required: agent.kind {kind!r} calls an LLM "
                             f"(only agent.kind {' or '.join(LLM_FREE_AGENTS)} may omit llm)")
        return llm

    @property
    def batch_mode(self) -> bool:
        return self.dapo.enabled or self.batches is not None


# Paths (camelCase, as in YAML) that cannot change once the job exists.
IMMUTABLE_FIELDS: tuple[tuple[str, ...], ...] = (
    ("tasks",),
    ("samplesPerPrompt",),
    ("executor", "kind"),
    ("executor", "kubernetes"),  # a Kubernetes Job's pod template cannot change; executor.nodes can
    ("sandbox", "runtime"),
    ("dapo", "enabled"),
)


def spec_value(spec: dict[str, Any], path: tuple[str, ...]) -> Any:
    """The value at a camelCase path of a wire-form spec, or None."""
    cur: Any = spec
    for key in path:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(key)
    return cur


# ---------------------------------------------------------------- the resource


class RolloutJob(Model):
    api_version: str = Field(alias="apiVersion")
    kind: str
    metadata: ObjectMeta
    spec: RolloutJobSpec
    status: RolloutJobStatus = Field(default_factory=RolloutJobStatus)

    @model_validator(mode="after")
    def _type(self) -> "RolloutJob":
        if self.api_version != API_VERSION:
            raise ValueError(f"apiVersion must be {API_VERSION!r}, got {self.api_version!r}")
        if self.kind != KIND:
            raise ValueError(f"kind must be {KIND!r}, got {self.kind!r}")
        return self
