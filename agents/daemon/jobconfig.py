"""The job's spec read once for the node: `JobConfig` (handler, AgentConfig, SandboxSpec, pools) and a rollout's identity.

`daemon.NodeDaemon` builds it after registering; `pipeline.Pipeline` runs every rollout with it, and every
trajectory the node reports (scored, failed or a stand-in, see outbox.py) is stamped by `JobConfig.stamp`.
"""
from __future__ import annotations

from dataclasses import dataclass

from rolloutd.crds.node import Lease
from rolloutd.crds.rolloutjob import RolloutJobSpec, SamplingSpec
from rolloutd.crds.tenancy import TenantPolicySpec, violations
from rolloutd.crds.kit.settings import SandboxSettings
from rolloutd.crds.trajectory import Failure, FailureKind, Trajectory
from rolloutd.sandbox import SandboxSpec

from ..llm import SamplingParams
from ..loop.rollout import AgentConfig, RolloutContext
from ..tasks.base import HandlerScope, TaskHandler
from ..tasks.registry import get_handler, handler_options
from .options import NodeError

SANDBOX_TOOLS = frozenset({"bash", "ipython", "editor"})


def load_spec(wire: dict) -> RolloutJobSpec:
    """The registration's job spec, validated; a spec this version cannot read is a `NodeError`."""
    try:
        return RolloutJobSpec.model_validate(wire)
    except Exception as e:  # noqa: BLE001 - a spec this version cannot read
        raise NodeError(f"the job's spec is not valid for this node: {e}") from None


def sampling_params(s: SamplingSpec) -> SamplingParams:
    """The spec's sampling as the LLM client's; only the per-turn limit changes its name."""
    fields = s.model_dump(exclude={"max_tokens_per_turn", "max_total_tokens"})
    return SamplingParams(**fields, max_tokens=s.max_tokens_per_turn)


@dataclass
class JobConfig:
    """What every rollout of this job on this node shares, derived from the spec once."""

    job: str
    node: str
    spec: RolloutJobSpec
    handler: TaskHandler
    agent: AgentConfig
    sandbox: SandboxSpec
    needs_sandbox: bool   # the handler or one of the agent's tools needs one
    eval_sandbox: bool    # EVAL scores in a fresh sandbox (`TaskHandler.eval_sandbox`)
    warm: int             # sandboxes the warm pool keeps started
    policy: TenantPolicySpec | None = None  # the TenantPolicy the controller holds the job to (None: the admin's)
    policy_name: str | None = None          # "TenantPolicy team-a" or "the restricted profile"

    def check_policy(self) -> None:
        """The node's own check of the spec against the policy the controller sent at registration (the one
        stored now, not the one at apply): a `NodeError` that fails the job as a configuration error naming
        each field and the policy."""
        found = violations(self.spec, self.policy)
        if found:
            why = "; ".join(f"{field}: {reason}" for field, reason in found)
            label = self.policy_name or "the tenant policy"
            raise NodeError(f"job {self.job!r} is forbidden by {label}: {why}", config=f"{why} (forbidden by {label})")

    @classmethod
    def build(cls, spec: RolloutJobSpec, *, job: str, node: str, handler: TaskHandler | None = None,
              policy: TenantPolicySpec | None = None, policy_name: str | None = None,
              sandbox_settings: SandboxSettings | None = None) -> "JobConfig":
        try:
            options = handler_options(spec.tasks.options)  # checked at apply against this handler
            handler = handler if handler is not None else get_handler(spec.tasks.kind, **options)
        except Exception as e:  # noqa: BLE001 - unknown kind: nothing can run
            raise NodeError(f"cannot set up job {job!r}: {type(e).__name__}: {e}") from None
        handler.bind(HandlerScope(roots=None if policy is None else tuple(policy.data_roots),
                                  sandbox_settings=sandbox_settings, quotas=None if policy is None else policy.quotas))
        tools = list(spec.agent.tools)
        needs_sandbox = bool(handler.needs_sandbox or SANDBOX_TOOLS & set(tools))
        sandbox = spec.sandbox  # the job's own spec.sandbox is what the runtimes take (one SandboxSpec)
        s, t = spec.agent.sampling, spec.timeouts
        agent = AgentConfig(
            max_turns=spec.agent.max_turns, max_tokens_per_turn=s.max_tokens_per_turn,
            max_total_tokens=s.max_total_tokens, tools=tools, sampling=sampling_params(s),
            action_timeout=t.action_seconds, drift_check=spec.agent.drift_check, run_timeout=t.run_seconds,
            agent_kind=spec.agent.kind, agent_command=spec.agent.command, system_prompt=spec.agent.system_prompt,
        )
        # a handler with per-task images (harbor) starts its own: warm ones of the job's image would idle
        warm = 0 if handler.sandbox_spec is not None else spec.sandbox.warm
        return cls(job=job, node=node, spec=spec, handler=handler, agent=agent, sandbox=sandbox,
                   needs_sandbox=needs_sandbox, eval_sandbox=needs_sandbox and handler.eval_sandbox, warm=warm,
                   policy=policy, policy_name=policy_name)

    def landable(self) -> int | None:
        """The most rollouts of this job that can be in flight at once as far as the spec tells (None: no bound
        known): samplesPerPrompt × the prompts it may have open, `tasks.limit` and a batch job's groups in flight."""
        spec, groups = self.spec, []
        if spec.tasks.limit is not None:
            groups.append(spec.tasks.limit)
        if spec.dapo.enabled:
            groups.append(spec.dapo.max_in_flight_groups or 2 * spec.dapo.target_groups)
        elif spec.batches is not None:
            groups.append(spec.batches.max_in_flight_groups or spec.batches.groups)
        return min(groups) * spec.samples_per_prompt if groups else None

    def first_wave(self, init: int) -> int:
        """How many sandboxes to warm for the job's first wave on this node: the INIT pool's width, never more
        than the rollouts that can land (a job of 4 rollouts on an INIT pool of 32 warms 4)."""
        bound = self.landable()
        return init if bound is None else min(init, bound)

    def default_backend(self) -> str | None:
        """The backend of a lease that names none: the job's first."""
        return self.spec.llm.backends[0].url if self.spec.llm.backends else None

    def task_id(self, task: dict) -> str | None:
        try:
            return self.handler.task_id(task)
        except Exception:  # noqa: BLE001 - a task without the id field
            return None

    # ------------------------------------------------------------------ a rollout's identity
    def context(self, lease: Lease, backend: str | None) -> RolloutContext:
        """Which rollout this is, as the agent loop copies it into the trajectory."""
        return RolloutContext(job=self.job, prompt=lease.prompt, sample=lease.sample, task_id=self.task_id(lease.task),
                              node=self.node, policy_version=lease.policy_version, backend=backend,
                              attempt=lease.attempt)

    def blank(self, lease: Lease) -> Trajectory:
        """A trajectory with nothing in it yet (a failure before or instead of RUN's)."""
        return Trajectory(job=self.job, prompt=lease.prompt, sample=lease.sample)

    def stamp(self, t: Trajectory, lease: Lease, backend: str | None) -> Trajectory:
        """Fill what the node knows better than the handler: which job, prompt, sample, attempt, node, backend."""
        t.job, t.prompt, t.sample, t.attempt = self.job, lease.prompt, lease.sample, lease.attempt
        t.node, t.backend, t.policy_version = self.node, backend, lease.policy_version
        if t.task_id is None:
            t.task_id = self.task_id(lease.task)
        return t

    def stand_in(self, lease: Lease, reason: str) -> Trajectory:
        """An infrastructure failure reported instead of a result the controller refused (see outbox.py)."""
        t = self.stamp(self.blank(lease), lease, lease.backend)
        t.finish_reason = "error"
        t.failure = Failure(kind=FailureKind.infra, reason=reason[:2000])
        return t
