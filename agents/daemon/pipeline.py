"""One rollout's way through the node: INIT (sandbox, task files) → RUN (agent loop) → EVAL (reward), then report.

Each stage waits for a slot in its own pool (`asyncio.Semaphore`, `spec.pipeline.workersPerNode`), so a slow EVAL
never stops RUN; `Pipeline._stage` is the one place a stage is stamped, timed, bounded and its failure classed.
The result goes to `outbox.Outbox`; the sandbox made in INIT serves RUN and EVAL and is closed when the rollout ends.

Failure classes: INIT failing or timing out, a RUN trajectory marked `infra`, a handler crashing, EVAL raising or
timing out → `failure.kind = infra`, `reward = None` (the controller retries or excludes it). A configuration
error (`rolloutd.crds.errors.classify` says `config`: `ConfigError`, ...) from INIT or RUN, or a trajectory
marked `config`, skips EVAL and is reported unscored as `config` (the job fails).
Agent failures go through EVAL and get a reward.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rolloutd.crds.errors import InfraError, RolloutdError, classify
from rolloutd.crds.kit.settings import SandboxSettings
from rolloutd.crds.trajectory import Failure, FailureKind, Timings, Trajectory
from rolloutd.sandbox import SandboxError, WarmPool, get_runtime

from ..llm import LLMBackend
from ..vllm_backend import VLLMBackend
from ..tasks.base import EvalError, as_reward
from ..tasks.seams import Sandbox, SandboxFactory
from .firstwave import FirstWave
from .jobconfig import JobConfig
from .llmgate import TrackedLLM
from .policygate import PolicyGate
from .outbox import Outbox
from .rollouts import Phase, Rollout, Rollouts
from .. import spans as node_traces


class _Infra(InfraError):
    """An infrastructure problem found by the node itself (reported as `infra`)."""


class _StageFailed(RolloutdError):
    """A stage failed for a reason that is not the policy's: `kind` `infra`, or `config` when INIT or RUN
    raised a configuration error (`classify`), reported with `reason`."""

    def __init__(self, reason: str, kind: FailureKind = FailureKind.infra) -> None:
        super().__init__(reason)
        self.reason, self.kind = reason, kind


def _describe(phase: Phase, e: Exception) -> str:
    """The failure reason of a stage that raised `e` (the words trajectories have always carried)."""
    name = phase.name
    if isinstance(e, _Infra):
        return f"{name}: {e}"
    if phase is Phase.INIT and isinstance(e, SandboxError):
        return f"INIT: sandbox: {type(e).__name__}: {e}"
    if phase is Phase.EVAL and not isinstance(e, (EvalError, SandboxError)):
        return f"EVAL crashed: {type(e).__name__}: {e}"   # the evaluator itself: never reward 0
    return f"{name}: {type(e).__name__}: {e}"


class Pipeline:
    """Runs the rollouts of one job on this node (`run(rollout)` is each rollout's task).

    Seams: `llm_factory(url) -> LLMBackend` (default `VLLMBackend`), `runtime` (a `SandboxRuntime`, default the
    spec's), `tokenizer` (set by the daemon once loaded), `wake_leasing()` (the lease loop re-checks `room`)."""

    def __init__(self, config: JobConfig, rollouts: Rollouts, outbox: Outbox, gate: PolicyGate, *,
                 log: logging.LoggerAdapter, stats: collections.Counter[str],
                 llm_factory: Callable[[str], LLMBackend] | None = None, runtime: Any = None,
                 tokenizer: Any = None, sandbox_settings: SandboxSettings | None = None,
                 wake_leasing: Callable[[], None] = lambda: None) -> None:
        self.config, self.rollouts, self.outbox, self.gate = config, rollouts, outbox, gate
        gate.tokens.episodes = rollouts.running_on  # token-share: the node's part of its job's share of a backend
        gate.rates.episodes = rollouts.running_on  # work-share: likewise, in processed tokens per second
        self.sandbox_settings = sandbox_settings  # the node's, for the spec's runtime (None: the defaults)
        self.log, self.stats = log, stats
        self.tokenizer = tokenizer
        self.runtime = runtime
        self.pool: WarmPool | None = None   # sandboxes started ahead of need (spec.sandbox.warm)
        self.first_wave: FirstWave | None = None   # paces the first wave's leases to the pool's warm sandboxes
        self._wake_leasing = wake_leasing
        self._llm_factory = llm_factory
        self._llms: dict[str, LLMBackend] = {}
        w = config.spec.pipeline.workers_per_node
        self.workers = {Phase.INIT: w.init, Phase.RUN: w.run, Phase.EVAL: w.eval}
        self._pools = {phase: asyncio.Semaphore(n) for phase, n in self.workers.items()}

    def start(self) -> None:
        """Start the warm pool, warming for a first wave as wide as the INIT pool or the rollouts that can land,
        whichever is fewer (`JobConfig.first_wave`; every way out of the daemon closes it: `aclose`), and lease that
        wave no faster than the pool warms (`FirstWave`; not with `spec.sandbox.warm: 0`: every INIT cold)."""
        if self.config.needs_sandbox:
            if self.runtime is None:
                self.runtime = get_runtime(self.config.spec.sandbox.runtime, self.sandbox_settings)
            # sized from the INIT rate, never holding more than the tenant's quota admitted for the job
            # (init + run + eval + warm, `crds.tenancy.violations`)
            self.pool = WarmPool(self.runtime, self.config.sandbox, self.config.warm,
                                 most=sum(self.workers.values()) + self.config.warm, on_created=self._sandbox_ready)
            width = self.config.first_wave(self.workers[Phase.INIT])
            self.pool.expect(width)
            self.pool.start()
            if self.pool.most is not None and width > 0:   # a pool sized from demand (warm > 0)
                self.first_wave = FirstWave(self.pool, width, self.rollouts, self._wake_leasing)

    def _sandbox_ready(self) -> None:
        """The pool ended a creation (idle or failed): a first wave still pacing re-checks its room."""
        if self.first_wave is not None:
            self.first_wave.sandbox_ready()

    async def aclose(self) -> None:
        """Every way out of the daemon: no warm sandbox left (what the pool served, logged), LLM clients closed."""
        if self.pool is not None:
            st = self.pool.stats
            self.log.info("warm pool: %d sandboxes handed out warm, %d created cold, %d warm starts failed",
                          st["warm"], st["cold"], st["failures"])
            await self.pool.close()
        for llm in self._llms.values():
            aclose = getattr(llm, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # noqa: BLE001 - closing at exit: nothing left to do about it
                    pass

    def room(self) -> int:
        """How many more leases fit (`Rollouts.room`), while the first wave is paced no more than `FirstWave.cap`."""
        room = self.rollouts.room(self.workers[Phase.INIT], self.workers[Phase.RUN])
        cap = self.first_wave.cap() if self.first_wave is not None else None
        return room if cap is None else min(room, cap)

    def report(self, r: Rollout, t: Trajectory) -> None:
        r.reported = True
        self.outbox.submit(r.aid, r.lease, t)

    # ------------------------------------------------------------------ one rollout
    async def run(self, r: Rollout) -> None:
        try:
            with node_traces.attempt(r, self.config.job, self.config.node, self.log) as span:
                trajectory = await self._stages(r)
                node_traces.outcome(span, trajectory)
            if not r.silent:
                self.report(r, trajectory)
        except asyncio.CancelledError:
            self.stats["cancelled"] += 1
            raise
        except Exception as e:  # noqa: BLE001 - a bug here must not take the node down
            self.log.exception("rollout %s: internal error", r.aid)
            if not r.silent:
                self.report(r, self.infra(r, None, f"node: internal error: {type(e).__name__}: {e}"))
        finally:
            r.closing = True
            try:
                await self._close(r)
            finally:  # even when cancelled again while closing
                self.rollouts.remove(r)

    async def _stages(self, r: Rollout) -> Trajectory:
        timeouts = self.config.spec.timeouts
        # the loop enforces runSeconds; the stage's bound only stops a handler that ignores it
        backstop = timeouts.run_seconds + max(30.0, timeouts.run_seconds * 0.1)
        try:
            await self._stage(r, Phase.INIT, lambda: self._init(r), r.leased_at, timeouts.init_seconds)
            self.rollouts.set_phase(r, Phase.WAIT_RUN)   # repins apply until RUN starts
            trajectory = await self._stage(r, Phase.RUN, lambda: self._run(r), time.monotonic(),
                                           timeouts.run_seconds, bound=backstop, leave=lambda: self._left_run(r))
        except _StageFailed as f:
            if f.kind is FailureKind.config:
                return self.config_failure(r, None, f.reason)
            self.log.warning("rollout %s: %s", r.aid, f.reason)
            return self.infra(r, None, f.reason)
        if trajectory.failure.kind == FailureKind.infra:
            self.log.warning("rollout %s: RUN: %s", r.aid, trajectory.failure.reason)
            return self.infra(r, trajectory, trajectory.failure.reason or "RUN: infrastructure failure")
        if trajectory.failure.kind == FailureKind.config:  # not the policy's doing: nothing to score
            return self.config_failure(r, trajectory, trajectory.failure.reason)

        # EVAL scores agent failures too: a legitimate reward
        if self.config.eval_sandbox and not self._pools[Phase.EVAL].locked():
            r.eval_sandbox = self._start_sandbox()
        try:
            value, details = await self._stage(r, Phase.EVAL, lambda: self._eval(r, trajectory), time.monotonic(),
                                               timeouts.eval_seconds)
        except _StageFailed as f:
            self.log.warning("rollout %s: %s", r.aid, f.reason)
            return self.infra(r, trajectory, f.reason)
        trajectory.reward = value
        trajectory.reward_details = {**trajectory.reward_details, **details}
        return self.finish(r, trajectory)

    async def _stage(self, r: Rollout, phase: Phase, work: Callable[[], Awaitable[Any]], since: float,
                     seconds: float, *, bound: float | None = None, leave: Callable[[], None] | None = None) -> Any:
        """Run `work()` as `phase` of `r` in the phase's pool: stamped, timed, bounded by `bound` (default
        `seconds`). A failure raises `_StageFailed` of the kind `classify` gives, but never `agent` (a stage
        that raises is not the policy's doing) and always `infra` in EVAL (the evaluator's).
        `leave()` runs as the stage ends, however it ends, while the slot is still held."""
        async with self._pools[phase]:
            self.rollouts.set_phase(r, phase)
            r.stamps[phase.value] = time.time()
            t0 = time.monotonic()
            r.waits[phase.value] = t0 - since
            try:
                async with asyncio.timeout(bound if bound is not None else seconds):
                    with node_traces.stage(phase.name, r.aid, t0 - since):
                        return await work()
            except TimeoutError:
                raise _StageFailed(f"{phase.name} exceeded {seconds:g}s") from None
            except Exception as e:  # noqa: BLE001 - classed here: never the policy's fault
                if classify(e) is FailureKind.config and phase is not Phase.EVAL:
                    raise _StageFailed(str(e), FailureKind.config) from None
                raise _StageFailed(_describe(phase, e)) from None
            finally:
                r.timings[phase.value] = time.monotonic() - t0
                if leave is not None:
                    leave()

    def _left_run(self, r: Rollout) -> None:
        self.rollouts.left(r)                 # the controller releases the backend slot
        self.rollouts.set_phase(r, Phase.WAIT_EVAL)

    async def _init(self, r: Rollout) -> None:
        handler = self.config.handler
        if self.config.needs_sandbox:
            if handler.sandbox_spec is not None:  # e.g. harbor: the task's own image
                spec = await handler.sandbox_spec(r.lease.task, self.config.sandbox)
                r.sandbox = await self._create_sandbox(lambda: self.runtime.create(spec))
            else:
                r.sandbox = await self._create_sandbox()
        await handler.init(r.lease.task, r.sandbox)

    async def _run(self, r: Rollout) -> Trajectory:
        cfg = self.config
        if r.backend is None and cfg.spec.llm.tokenizer is not None:
            raise _Infra("no LLM backend is pinned to this task and the job lists none")
        r.llm = TrackedLLM(self._llm(r.backend), self.gate, mode=cfg.spec.policy.update_mode,
                           url=r.backend) if r.backend is not None else None
        trajectory = await cfg.handler.run(r.lease.task, r.sandbox, r.llm, tokenizer=self.tokenizer,
                                           config=cfg.agent, ctx=cfg.context(r.lease, r.backend))
        if not isinstance(trajectory, Trajectory):
            raise _Infra(f"the handler's run returned {type(trajectory).__name__}, not a Trajectory")
        return trajectory

    async def _eval(self, r: Rollout, trajectory: Trajectory) -> tuple[float, dict]:
        kwargs: dict[str, SandboxFactory] = {}
        if r.eval_sandbox is not None:   # started as RUN ended (`TaskHandler.eval_sandbox`)
            pre = r.eval_sandbox

            async def fresh() -> Sandbox:
                return await asyncio.shield(pre)  # closed in _close if EVAL is cut short

            kwargs["sandbox_factory"] = fresh
        reward = as_reward(await self.config.handler.eval(r.lease.task, r.sandbox, trajectory, **kwargs))
        if not math.isfinite(reward.value):
            raise EvalError(f"EVAL returned a non-finite reward {reward.value!r}")
        return reward.value, dict(reward.details)

    def _llm(self, url: str) -> LLMBackend:
        llm = self._llms.get(url)
        if llm is None:
            llm = self._llm_factory(url) if self._llm_factory else VLLMBackend(url, model=self.config.spec.llm.model)
            self._llms[url] = llm
        return llm

    # ------------------------------------------------------------------ sandboxes
    def _start_sandbox(self) -> asyncio.Task:
        """A sandbox for one rollout: from the warm pool (a fresh, already-started one), or created cold."""
        return self.rollouts.spawn(self.pool.acquire())

    async def _create_sandbox(self, create: Callable[[], Awaitable[Any]] | None = None) -> Any:
        """A new sandbox (`create()`, default the warm pool). Its start-up is never cancelled half-way
        (rolloutd.sandbox would leave its directory behind): if cancelled meanwhile, it is closed once up."""
        task = self.rollouts.spawn(create()) if create is not None else self._start_sandbox()
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self.rollouts.spawn(close_pending(task))
            raise

    async def _close(self, r: Rollout) -> None:
        """Close the rollout's sandboxes; survives a second cancel (the close runs in its own task)."""
        closers = []
        if r.sandbox is not None:
            closers.append(r.sandbox.close())
        if r.eval_sandbox is not None:
            closers.append(close_pending(r.eval_sandbox))
        if not closers:
            return
        task = self.rollouts.spawn(asyncio.gather(*closers, return_exceptions=True))
        try:
            results = await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task], timeout=30)
            raise
        for res in results:
            if isinstance(res, BaseException):
                self.log.warning("rollout %s: closing a sandbox: %r", r.aid, res)

    # ------------------------------------------------------------------ what is reported
    def finish(self, r: Rollout, t: Trajectory) -> Trajectory:
        """Fill what the node knows better than the handler: identity, backend, policy versions, timings."""
        lease = r.lease
        self.config.stamp(t, lease, r.backend)
        t.admitted_version = lease.policy_version
        if r.llm is not None and r.llm.versions:  # the versions that actually generated each turn
            t.policy_versions = [v for v in r.llm.versions if v is not None]
            t.policy_version = r.llm.versions[0] if r.llm.versions[0] is not None else lease.policy_version
        t.timings = Timings(queue=lease.queued_seconds, init=r.timings.get("init", 0.0),
                            run=r.timings.get("run", 0.0), eval=r.timings.get("eval", 0.0),
                            stamps={**r.stamps, "end": time.time()})
        t.metrics = {**t.metrics, **{f"node_wait_{k}_seconds": round(v, 6) for k, v in r.waits.items()}}
        return t

    def infra(self, r: Rollout, t: Trajectory | None, reason: str) -> Trajectory:
        """An infrastructure failure: reported, never a reward."""
        self.stats["infra"] += 1
        return self._failed(r, t, FailureKind.infra, reason)

    def config_failure(self, r: Rollout, t: Trajectory | None, reason: str) -> Trajectory:
        """The job's configuration made the rollout impossible: reported unscored (the controller
        fails the job with `reason`, which names the spec field)."""
        self.stats["config"] += 1
        self.log.error("rollout %s: configuration: %s", r.aid, reason)
        return self._failed(r, t, FailureKind.config, reason)

    def _failed(self, r: Rollout, t: Trajectory | None, kind: FailureKind, reason: str) -> Trajectory:
        t = t if t is not None else self.config.blank(r.lease)
        t.reward = None
        t.failure = Failure(kind=kind, reason=reason[:2000])
        t.finish_reason = t.finish_reason or "error"
        return self.finish(r, t)


async def close_pending(task: asyncio.Task) -> None:
    """Close a sandbox that is being (or was) created in the background, once it is up."""
    try:
        sandbox = await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():  # we were cancelled, not the creation: let it finish elsewhere
            asyncio.get_running_loop().create_task(close_pending(task))
        raise
    except Exception:  # noqa: BLE001 - creation failed: nothing to close
        return
    await sandbox.close()
