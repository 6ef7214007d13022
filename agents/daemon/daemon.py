"""The node daemon (`rolloutd node`): registers with the controller, leases work, runs every rollout
through INIT → RUN → EVAL on three independent worker pools, reports trajectories.

Where it sits: started once per allocated node, by Slurm (`srun rolloutd node`) or by the controller's
local executor (a subprocess; the same code path). It talks to the controller only through the node
protocol (`rolloutd.crds.node`, client in `agents/daemon/controller_client.py`), drives sandboxes through
`rolloutd.sandbox`, task handlers through `rolloutd.agents.tasks` and LLM backends through
`rolloutd.agents.llm`. It never touches SQLite; the controller owns every scheduling decision.

Flow of one rollout (one asyncio task per lease, `NodeDaemon._pipeline`):

    leased ──INIT pool──▶ init ─▶ wait_run ──RUN pool──▶ run ─▶ wait_eval ──EVAL pool──▶ eval ─▶ report
           (sandbox created, task files staged)  (agent loop)   (backend slot released)  (Reward)

Each pool is an `asyncio.Semaphore` sized from `spec.pipeline.workersPerNode`; a rollout releases one
stage's slot before it waits for the next, so a slow EVAL never stops RUN from taking new rollouts.
The sandbox made in INIT is used by RUN and EVAL and always closed when the rollout ends (finally).
Work is leased only while (leased + init) < init workers and (wait_run + run) < run workers.

Failure classes: INIT failing or timing out, a RUN trajectory marked `infra`, a handler crashing,
EVAL raising (`EvalError`, `SandboxError`, anything) or timing out → the trajectory is reported with
`failure.kind = infra` and `reward = None` (the controller retries or excludes it). A rollout the
job's configuration made impossible (`ConfigError` from INIT or RUN, a trajectory marked `config`:
the prompt does not fit the token budget, the backend refuses the request) skips EVAL and is
reported unscored as `config` (the controller fails the job). Agent failures go through EVAL and
get a reward.

Control: heartbeats every `heartbeatSeconds` (longer in a big job) and promptly on stage changes (≥
`crds.node.heartbeat_min_gap` apart: a fifth of the interval, 50 ms at least) carry each live
attempt's stage and the attempts that left RUN. The reply may `cancel` an attempt (sandbox closed,
in-flight LLM request aborted server-side, slots freed, nothing reported), `repin` it to another
backend (if not in RUN yet), declare it `unknown` (dropped) or `drain` the node. SIGTERM/SIGINT:
stop leasing, hand back unstarted leases, give in-flight rollouts `ROLLOUTD_DRAIN_SECONDS` (default
30) to finish, cancel and hand back the rest, deregister, exit 0. A second signal cuts the grace
period short.

Results are serialized once, buffered and resent with back-off until the controller answers (it
deduplicates by attemptId); an attempt it no longer leases comes back in `dropped` and is forgotten.
Batches are capped by count and bytes; a batch refused as too large (413) is resent one by one, and
a result refused for good becomes an `infra` failure of its attempt (retried or given up, never
left leased). Trajectories carry `timings.stamps` (wall-clock start of each stage and the end).

Sandboxes: INIT takes one from the daemon's warm pool (`rolloutd.sandbox.WarmPool`: `spec.sandbox.warm`
sandboxes started ahead of need, each handed out once; created cold when the pool is empty); the pool is
closed on every way out of `run`. A sandbox start is never cancelled half-way (closed once it is up
instead); a cancel that lower layers swallow (3.11's `asyncio.wait_for` does when a reply lands at the
same moment) is repeated until the rollout reaches its clean-up.

Test seams (all keyword arguments of `NodeDaemon`): `client` (a `ControllerClient`), `handler` (a
`TaskHandler` instead of `get_handler(spec.tasks.kind)`), `llm_factory(url) -> LLMBackend`,
`tokenizer`, `sandbox_runtime` (a `SandboxRuntime`); `NodeDaemon.transitions` records every
(monotonic time, attemptId, phase), `NodeDaemon.stats` counts calls and failures.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import math
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rolloutd.crds.node import (
    NODE_PROTOCOL,
    Heartbeat,
    HeartbeatResponse,
    Lease,
    LeaseRequest,
    RegisterRequest,
    RegisterResponse,
    Result,
    ReturnRequest,
    heartbeat_min_gap,
)
from rolloutd.crds.rolloutjob import RolloutJobSpec
from rolloutd.crds.trajectory import Failure, FailureKind, Timings, Trajectory
from rolloutd.sandbox import SandboxError, SandboxSpec, WarmPool, get_runtime

from ..llm import LLMBackend, SamplingParams, VLLMBackend
from ..aiokit import Backoff
from .controller_client import ControllerClient, ControllerError, result_json
from .supervise import EXIT_REFUSED
from ..tasks.base import ConfigError, EvalError, TaskHandler, get_handler
from ..rollout import AgentConfig, RolloutContext

log = logging.getLogger("rolloutd.node")

ENV_CONTROLLER = "ROLLOUTD_CONTROLLER"
ENV_JOB = "ROLLOUTD_JOB"
ENV_TOKEN = "ROLLOUTD_JOIN_TOKEN"
ENV_DRAIN = "ROLLOUTD_DRAIN_SECONDS"

SANDBOX_TOOLS = frozenset({"bash", "ipython", "editor"})

# phase (fine-grained, on the node) → stage (on the wire, `crds.node.Stage`)
WIRE_STAGE = {"leased": "leased", "init": "init", "wait_run": "init", "run": "run",
              "wait_eval": "eval", "eval": "eval"}


SAME_SIGNAL_SECONDS = 1.0  # a second SIGTERM sooner than this is a duplicate, not "hurry"


class NodeError(Exception):
    """The daemon cannot go on (bad token, unknown job, unusable spec): exit `EXIT_REFUSED`.
    `config`: the job's spec is at fault (a reason naming the field): reported so the job fails."""

    def __init__(self, message: str, *, config: str | None = None) -> None:
        super().__init__(message)
        self.config = config


# ---------------------------------------------------------------------------------- options
@dataclass
class NodeOptions:
    """Who this daemon is and how it talks to the controller. `from_env` fills it like the CLI."""

    controller: str
    job: str
    token: str
    name: str
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    slot: int | None = None
    slurm_job_id: str | None = None
    slurm_node_id: int | None = None
    drain_seconds: float = 30.0          # SIGTERM grace period for in-flight rollouts
    lease_wait: float = 1.5              # long-poll of one /lease call
    register_timeout: float = 120.0      # keep trying to register this long (controller starting)
    flush_seconds: float = 15.0          # at exit, keep trying to deliver results this long
    result_coalesce: float = 0.005       # results finished this close together go in one batch
    result_batch: int = 64               # results per /results call at most ...
    result_batch_bytes: int = 512 * 1024  # ... and bytes (the controller limits request bodies)
    heartbeat_min_gap: float = 0.05
    retry_max: float = 5.0               # longest back-off between retries to an unreachable controller

    @classmethod
    def from_env(cls, *, controller: str | None = None, job: str | None = None, name: str | None = None,
                 slot: int | None = None, environ: dict[str, str] | None = None) -> "NodeOptions":
        env = os.environ if environ is None else environ
        controller = controller or env.get(ENV_CONTROLLER)
        job = job or env.get(ENV_JOB)
        token = env.get(ENV_TOKEN)
        if not controller:
            raise NodeError(f"no controller URL: pass --controller or set {ENV_CONTROLLER}")
        if not job:
            raise NodeError(f"no job: pass --job or set {ENV_JOB}")
        if not token:
            raise NodeError(f"no join token: set {ENV_TOKEN} (never on the command line)")
        node_id = env.get("SLURM_NODEID")
        try:
            drain = float(env.get(ENV_DRAIN, "30"))
        except ValueError:
            raise NodeError(f"{ENV_DRAIN} must be a number of seconds, got {env.get(ENV_DRAIN)!r}") from None
        return cls(
            controller=controller, job=job, token=token,
            name=name or env.get("SLURMD_NODENAME") or socket.gethostname(),
            slot=slot, slurm_job_id=env.get("SLURM_JOB_ID") or None,
            slurm_node_id=int(node_id) if node_id and node_id.isdigit() else None,
            drain_seconds=max(drain, 0.0),
        )


# ---------------------------------------------------------------------------------- per rollout
class PolicyGate:
    """The node's view of the job's policy: the version new LLM requests are tagged with, and
    whether new requests must wait (the weights are being updated). The controller sets both
    through heartbeat replies and waits until `inflight` reaches 0 before it touches the weights,
    so no request ever spans two versions."""

    def __init__(self, version: int | str | None = None) -> None:
        self.version = version
        self.inflight = 0
        self.on_change: Callable[[], None] = lambda: None  # tell the controller soon (a heartbeat)
        self._open = asyncio.Event()
        self._open.set()

    def set(self, version: int | str | None, paused: bool) -> None:
        self.version = version if version is not None else self.version
        if paused and self._open.is_set():
            self._open.clear()
            self.on_change()  # report "held, N in flight" without waiting for the next beat
        elif not paused:
            self._open.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def enter(self) -> int | str | None:
        while True:
            await self._open.wait()
            if self._open.is_set():  # still open after the wake-up
                self.inflight += 1
                return self.version

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0 and self.paused:
            self.on_change()


class TrackedLLM:
    """Wraps the shared backend for one rollout: remembers which request ids are in flight, so a
    cancel can abort them server-side (`abort_in_flight`), holds new requests while the policy is
    being updated, and records the policy version of every turn."""

    def __init__(self, inner: LLMBackend, gate: PolicyGate | None = None) -> None:
        self.inner = inner
        self.gate = gate or PolicyGate()
        self.in_flight: set[str] = set()
        self.versions: list[int | str | None] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str):
        version = await self.gate.enter()
        self.in_flight.add(request_id)
        try:
            gen = await self.inner.generate(prompt_ids, sampling, request_id)
            self.versions.append(version)
            return gen
        finally:
            self.in_flight.discard(request_id)
            self.gate.leave()

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    def __getattr__(self, name: str) -> Any:  # model, max_model_len, ... of the shared backend
        return getattr(self.inner, name)


@dataclass(eq=False)
class Rollout:
    lease: Lease
    backend: str | None
    leased_at: float
    phase: str = "leased"
    task: asyncio.Task | None = None
    sandbox: Any = None
    eval_sandbox: asyncio.Task | None = None
    llm: TrackedLLM | None = None
    silent: bool = False          # cancelled / unknown / returned: report nothing
    reported: bool = False        # its result is in the outbox (the rollout is only closing up)
    closing: bool = False         # in its final clean-up (sandboxes being closed)
    ran: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    waits: dict[str, float] = field(default_factory=dict)
    stamps: dict[str, float] = field(default_factory=dict)   # epoch seconds each stage began

    @property
    def aid(self) -> str:
        return self.lease.attempt_id


class _NodeLog(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.extra['node']}] {msg}", kwargs


# ---------------------------------------------------------------------------------- the daemon
class NodeDaemon:
    """One node's daemon. `await run()` returns the exit code; `request_stop()` is SIGTERM."""

    def __init__(
        self,
        options: NodeOptions,
        *,
        client: ControllerClient | None = None,
        handler: TaskHandler | None = None,
        llm_factory: Callable[[str], LLMBackend] | None = None,
        tokenizer: Any = None,
        sandbox_runtime: Any = None,
        install_signals: bool = False,
    ) -> None:
        self.opts = options
        self.name = options.name
        self.log = _NodeLog(log, {"node": options.name})
        self.client = client or ControllerClient(options.controller, options.token)
        self._owns_client = client is None
        self._handler = handler
        self._llm_factory = llm_factory
        self._tokenizer = tokenizer
        self._runtime = sandbox_runtime
        self._pool: WarmPool | None = None   # sandboxes started ahead of need (spec.sandbox.warm)
        self._install_signals = install_signals

        self.node_id: str | None = None
        self.spec: RolloutJobSpec | None = None
        self.registration: RegisterResponse | None = None
        self._llms: dict[str, LLMBackend] = {}
        self.gate = PolicyGate()
        self._rollouts: dict[str, Rollout] = {}
        self._left_run: set[str] = set()
        self._outbox: dict[str, _Outgoing] = {}        # finished, not yet acknowledged
        self._bg: set[asyncio.Task] = set()             # aborts, sandbox closes, cancels
        self._loops: list[asyncio.Task] = []
        self._lease_task: asyncio.Task | None = None

        self._stop_requested = False
        self._stop_requested_at = 0.0
        self._hard_stop = False
        self._stopping = False     # no more leasing (SIGTERM)
        self._draining = False     # no more leasing (controller's drain)
        self._done = False         # the controller has no more work for us
        self._fatal: str | None = None
        self._last_hb = 0.0
        self._hb_interval = 5.0
        self._lease_seconds = 30.0

        self.transitions: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=100_000)
        self.stats: collections.Counter[str] = collections.Counter()

    # ------------------------------------------------------------------ events (lazily, in the loop)
    def _events(self) -> None:
        self._wake = asyncio.Event()       # the supervisor re-checks its exit conditions
        self._room = asyncio.Event()       # the lease loop re-checks its room
        self._hb_wake = asyncio.Event()    # a stage changed: beat soon
        self._outbox_event = asyncio.Event()
        self._stop_event = asyncio.Event()
        self._hard_event = asyncio.Event()
        self.gate.on_change = self._hb_wake.set

    def _changed(self, *, stage: bool = False) -> None:
        self._wake.set()
        self._room.set()
        if stage:
            self._hb_wake.set()

    def request_stop(self, why: str = "SIGTERM") -> None:
        """Begin the graceful shutdown (what SIGTERM does); a second call skips the grace period.

        A second call within `SAME_SIGNAL_SECONDS` is the same stop delivered twice — Slurm signals
        every process of a step, so a daemon under `--restarts` gets it directly and forwarded by
        its supervisor — and is ignored."""
        if self._stop_requested:
            if time.monotonic() - self._stop_requested_at < SAME_SIGNAL_SECONDS:
                return
            if not self._hard_stop:
                self.log.warning("%s again: cancelling in-flight rollouts now", why)
            self._hard_stop = True
            self._hard_event.set()
            return
        self.log.info("%s: stop leasing, hand back unstarted work, drain in-flight rollouts", why)
        self._stop_requested = True
        self._stop_requested_at = time.monotonic()
        self._stopping = True
        self._stop_event.set()
        self._changed()

    # ------------------------------------------------------------------ main
    async def run(self) -> int:
        self._events()
        loop = asyncio.get_running_loop()
        signals: list[int] = []
        if self._install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.request_stop, sig.name)
                signals.append(sig)
        try:
            try:
                if not await self._register():
                    return 0
                self.spec = self._spec()
                # beating while the tokenizer loads (1-9 s on a busy node): a silent node is declared lost
                self._loops = [asyncio.create_task(self._heartbeat_loop(), name="heartbeat")]
                await self._load_tokenizer()
                self._build()
            except NodeError as e:
                self.log.error("%s", e)
                if e.config and self.node_id is not None:
                    await self._report_config(e.config)
                if self.node_id is not None:
                    await self._deregister()
                return EXIT_REFUSED  # a restart cannot help (agents/daemon/supervise.py does not retry it)
            self._lease_task = asyncio.create_task(self._lease_loop(), name="lease")
            self._loops += [self._lease_task, asyncio.create_task(self._result_loop(), name="results")]
            reason = await self._supervise()
            code = 0
            if reason == "stop":
                await self._shutdown()
            elif reason == "fatal":
                self.log.error("%s", self._fatal)
                await self._cancel_all("the controller no longer knows this node")
                code = 1
            else:
                self.log.info("%s and nothing in flight: exiting", reason)
            await self._flush_results()
            if self._left_run and not self._fatal:
                await self._beat()    # the last attempts that left RUN: their backend slots
            for task in self._loops:  # no heartbeat after deregistering
                await _insist_cancel(task, timeout=10)
            await self._deregister()
            return code
        finally:
            for task in self._loops:
                task.cancel()
            for task in list(self._rollouts.values()):
                if task.task is not None:
                    task.task.cancel()
            pending = [t for t in (*self._loops, *(r.task for r in self._rollouts.values() if r.task)) if t]
            if pending:
                await asyncio.wait(pending, timeout=30)
            if self._bg:
                await asyncio.wait(list(self._bg), timeout=30)
            if self._pool is not None:  # every path out (done, drain, SIGTERM, fatal): no warm sandbox left
                await self._pool.close()
            for llm in self._llms.values():
                with contextlib.suppress(Exception):
                    aclose = getattr(llm, "aclose", None)
                    if aclose is not None:
                        await aclose()
            if self._owns_client:
                await self.client.aclose()
            for sig in signals:
                # From here on the daemon is exiting with its code: a late SIGTERM (Slurm's scancel
                # racing a daemon that already finished) must not turn exit 0 into "killed by signal"
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_IGN)

    async def _supervise(self) -> str:
        while True:
            if self._stop_requested:
                return "stop"
            if self._fatal:
                return "fatal"
            if (self._done or self._draining) and not self._rollouts and not self._outbox \
                    and self._lease_task is not None and self._lease_task.done():
                return "the job is done" if self._done else "drained"
            await self._wake.wait()
            self._wake.clear()

    # ------------------------------------------------------------------ registration and set-up
    async def _register(self) -> bool:
        o = self.opts
        req = RegisterRequest(job=o.job, protocol=NODE_PROTOCOL, name=o.name, host=o.host, pid=o.pid,
                              slurm_job_id=o.slurm_job_id, slurm_node_id=o.slurm_node_id, slot=o.slot)
        backoff = Backoff(0.2, self.opts.retry_max)
        deadline = time.monotonic() + o.register_timeout
        while True:
            if self._stop_requested:
                return False
            try:
                resp = await self.client.register(req)
                break
            except ControllerError as e:
                if e.status == 409:  # the job finished or is being deleted: nothing to do, not a failure
                    self.log.info("not registering: %s", e)
                    return False
                if not e.retryable:
                    raise NodeError(f"registration refused by {o.controller}: {e}") from None
                if time.monotonic() > deadline:
                    raise NodeError(f"cannot reach the controller at {o.controller} for "
                                    f"{o.register_timeout:g}s: {e}") from None
                self.log.warning("register: %s; retrying", e)
                await self._sleep_unless_stopped(backoff.next())
        self.registration = resp
        self.node_id = resp.node_id
        self._hb_interval = max(resp.heartbeat_seconds, 0.05)
        self._lease_seconds = resp.lease_seconds
        self.log.info("registered with %s as node %s for job %s (generation %s)", o.controller, resp.node_id,
                      resp.job, resp.generation)
        return True

    def _spec(self) -> RolloutJobSpec:
        """The registration's job spec, validated (once, by `run`: it is `self.spec` from then on)."""
        assert self.registration is not None
        try:
            return RolloutJobSpec.model_validate(self.registration.spec)
        except Exception as e:  # noqa: BLE001 - a spec this version cannot read
            raise NodeError(f"the job's spec is not valid for this node: {e}") from None

    async def _load_tokenizer(self) -> None:
        """In a thread: importing transformers and reading a tokenizer blocks for seconds."""
        if self._tokenizer is not None or self.spec.llm.tokenizer is None:  # None: an agent without LLM (oracle)
            return
        path = self.spec.llm.tokenizer

        def load():
            from ..tokenizer import ChatTokenizer
            return ChatTokenizer(path)

        try:
            self._tokenizer = await asyncio.to_thread(load)
        except Exception as e:  # noqa: BLE001 - a missing or unreadable tokenizer: nothing can run
            raise NodeError(f"cannot set up job {self.opts.job!r}: {type(e).__name__}: {e}",
                            config=f"spec.llm.tokenizer: cannot load {path!r}: {type(e).__name__}: {e}") from None

    def _build(self) -> None:
        spec = self.spec
        try:
            if self._handler is None:
                self._handler = get_handler(spec.tasks.kind)
        except Exception as e:  # noqa: BLE001 - unknown kind: nothing can run
            raise NodeError(f"cannot set up job {self.opts.job!r}: {type(e).__name__}: {e}") from None
        tools = list(spec.agent.tools)
        self._needs_sandbox = bool(self._handler.needs_sandbox or SANDBOX_TOOLS & set(tools))
        self._sandbox_spec = SandboxSpec.from_limits(
            runtime=spec.sandbox.runtime, image=spec.sandbox.image, network=spec.sandbox.network,
            limits=spec.sandbox.limits.wire(),
            mounts=[m.model_dump() for m in spec.sandbox.mounts],  # the same fields as sandbox.models.Mount
        )
        if self._needs_sandbox and self._runtime is None:
            self._runtime = get_runtime(spec.sandbox.runtime)
        s = spec.agent.sampling
        sampling = SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
            max_tokens=s.max_tokens_per_turn, seed=s.seed, stop=list(s.stop),
            repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
        )
        t = spec.timeouts
        self._config = AgentConfig(
            max_turns=spec.agent.max_turns, max_tokens_per_turn=s.max_tokens_per_turn,
            max_total_tokens=s.max_total_tokens, tools=tools, sampling=sampling,
            action_timeout=t.action_seconds, drift_check=spec.agent.drift_check, run_timeout=t.run_seconds,
            agent_kind=spec.agent.kind, agent_command=spec.agent.command,
        )
        w = spec.pipeline.workers_per_node
        self.workers = {"init": w.init, "run": w.run, "eval": w.eval}
        self._init_pool = asyncio.Semaphore(w.init)
        self._run_pool = asyncio.Semaphore(w.run)
        self._eval_pool = asyncio.Semaphore(w.eval)
        try:
            params = inspect.signature(self._handler.eval).parameters
        except (TypeError, ValueError):
            params = {}
        # a handler whose EVAL takes a fresh sandbox (swe) gets one started as RUN ends
        self._eval_takes_sandbox = self._needs_sandbox and "sandbox_factory" in params
        if self._needs_sandbox:  # last: nothing after it can fail and leave the pool running
            # a handler with per-task images (harbor) starts its own: warm ones of the job's image would idle
            warm = 0 if hasattr(self._handler, "sandbox_spec") else spec.sandbox.warm
            self._pool = WarmPool(self._runtime, self._sandbox_spec, warm)
            self._pool.start()
        self.log.info("job %s: tasks %s, sandbox %s (%s, %d warm), pools init=%d run=%d eval=%d", self.opts.job,
                      spec.tasks.kind, spec.sandbox.runtime if self._needs_sandbox else "none",
                      spec.sandbox.image, spec.sandbox.warm if self._needs_sandbox else 0, w.init, w.run, w.eval)

    def _llm(self, url: str) -> LLMBackend:
        llm = self._llms.get(url)
        if llm is None:
            assert self.spec is not None
            llm = self._llm_factory(url) if self._llm_factory else VLLMBackend(url, model=self.spec.llm.model)
            self._llms[url] = llm
        return llm

    # ------------------------------------------------------------------ leasing
    def room(self) -> int:
        """How many more leases fit: (leased + init) < init workers and (wait_run + run) < run workers."""
        n = collections.Counter(r.phase for r in self._rollouts.values())
        init_room = self.workers["init"] - n["leased"] - n["init"]
        run_room = self.workers["run"] - n["wait_run"] - n["run"]
        return max(0, min(init_room, run_room))

    def _leasing(self) -> bool:
        return not (self._stopping or self._draining or self._done or self._fatal)

    async def _lease_loop(self) -> None:
        assert self.node_id is not None
        backoff = Backoff(0.2, self.opts.retry_max)
        try:
            while self._leasing():
                room = self.room()
                if room <= 0:
                    self._room.clear()
                    if self.room() <= 0:
                        await self._room.wait()
                    continue
                try:
                    resp = await self.client.lease(self.node_id, LeaseRequest(max_items=room, wait=self.opts.lease_wait))
                    self.stats["lease_calls"] += 1
                except ControllerError as e:
                    self.stats["lease_failures"] += 1
                    if e.gone:
                        self._fatal = f"lease: {e}"
                        return
                    self.log.warning("lease: %s; retrying", e)
                    await self._sleep_unless_stopped(backoff.next())
                    continue
                backoff.reset()
                if resp.leases:
                    if self._stopping:  # SIGTERM arrived during the long-poll: never start these
                        await self._give_back([lease.attempt_id for lease in resp.leases],
                                              "node shutting down: not started")
                    else:
                        for lease in resp.leases:
                            self._start(lease)
                if resp.done:
                    self.log.info("the controller has no more work for this node")
                    self._done = True
                if resp.drain:
                    self._start_drain("the controller asked this node to drain (lease)")
        finally:
            self._changed()

    def _start(self, lease: Lease) -> None:
        if lease.attempt_id in self._rollouts:
            self.log.warning("lease %s received twice; ignoring the copy", lease.attempt_id)
            return
        backend = lease.backend
        if backend is None and self.spec is not None and self.spec.llm.backends:
            backend = self.spec.llm.backends[0].url
        r = Rollout(lease=lease, backend=backend, leased_at=time.monotonic())
        self._rollouts[r.aid] = r
        self.transitions.append((r.leased_at, r.aid, "leased"))
        self.stats["leased"] += 1
        r.task = asyncio.create_task(self._pipeline(r), name=f"rollout-{r.aid}")
        self._changed(stage=True)

    def _start_drain(self, why: str) -> None:
        if not self._draining:
            self.log.info("%s: no more leasing, finishing in-flight rollouts", why)
        self._draining = True
        self._changed()

    # ------------------------------------------------------------------ the pipeline
    def _set_phase(self, r: Rollout, phase: str) -> None:
        old = WIRE_STAGE.get(r.phase)
        r.phase = phase
        self.transitions.append((time.monotonic(), r.aid, phase))
        self._changed(stage=WIRE_STAGE.get(phase) != old)

    async def _pipeline(self, r: Rollout) -> None:
        try:
            trajectory = await self._stages(r)
            if trajectory is not None and not r.silent:
                self._submit(r, trajectory)
        except asyncio.CancelledError:
            self.stats["cancelled"] += 1
            raise
        except Exception as e:  # noqa: BLE001 - a bug here must not take the node down
            self.log.exception("rollout %s: internal error", r.aid)
            if not r.silent:
                self._submit(r, self._infra(r, None, f"node: internal error: {type(e).__name__}: {e}"))
        finally:
            r.closing = True
            try:
                await self._close(r)
            finally:  # even when cancelled again while closing
                self._rollouts.pop(r.aid, None)
                self.transitions.append((time.monotonic(), r.aid, "gone"))
                self._changed(stage=True)

    async def _stages(self, r: Rollout) -> Trajectory | None:
        assert self.spec is not None and self._handler is not None
        lease, timeouts, handler = r.lease, self.spec.timeouts, self._handler
        task = lease.task

        # ---- INIT: create the sandbox, stage the task's files
        failure: str | None = None
        async with self._init_pool:
            self._set_phase(r, "init")
            r.stamps["init"] = time.time()
            t0 = time.monotonic()
            r.waits["init"] = t0 - r.leased_at
            try:
                async with asyncio.timeout(timeouts.init_seconds):
                    await self._init(r)
            except TimeoutError:
                failure = f"INIT exceeded {timeouts.init_seconds:g}s"
            except ConfigError as e:
                return self._config_failure(r, None, str(e))
            except SandboxError as e:
                failure = f"INIT: sandbox: {type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - the task files could not be staged
                failure = f"INIT: {type(e).__name__}: {e}"
            r.timings["init"] = time.monotonic() - t0
        if failure is not None:
            self.log.warning("rollout %s: %s", r.aid, failure)
            return self._infra(r, None, failure)

        # ---- RUN: the agent loop, on the backend pinned to the task (repins apply until here)
        self._set_phase(r, "wait_run")
        t_wait = time.monotonic()
        trajectory: Trajectory | None = None
        async with self._run_pool:
            self._set_phase(r, "run")
            r.stamps["run"] = time.time()
            r.ran = True
            t0 = time.monotonic()
            r.waits["run"] = t0 - t_wait
            try:
                if r.backend is None and self.spec.llm.tokenizer is not None:
                    raise _Infra("no LLM backend is pinned to this task and the job lists none")
                r.llm = TrackedLLM(self._llm(r.backend), self.gate) if r.backend is not None else None
                ctx = RolloutContext(
                    job=self.opts.job, prompt=lease.prompt, sample=lease.sample, task_id=self._task_id(task),
                    node=self.name, policy_version=lease.policy_version, backend=r.backend, attempt=lease.attempt,
                )
                # the loop enforces runSeconds; this only bounds a handler that ignores it
                backstop = timeouts.run_seconds + max(30.0, timeouts.run_seconds * 0.1)
                async with asyncio.timeout(backstop):
                    trajectory = await handler.run(task, r.sandbox, r.llm, tokenizer=self._tokenizer,
                                                   config=self._config, ctx=ctx)
                if not isinstance(trajectory, Trajectory):
                    raise _Infra(f"the handler's run returned {type(trajectory).__name__}, not a Trajectory")
            except TimeoutError:
                failure = f"RUN exceeded {timeouts.run_seconds:g}s"
            except ConfigError as e:
                trajectory = Trajectory(job=self.opts.job, prompt=lease.prompt, sample=lease.sample,
                                        failure=Failure(kind=FailureKind.config, reason=str(e)[:2000]))
            except _Infra as e:
                failure = f"RUN: {e}"
            except Exception as e:  # noqa: BLE001 - the handler crashed: not the policy's fault
                failure = f"RUN: {type(e).__name__}: {e}"
            finally:
                r.timings["run"] = time.monotonic() - t0
                self._left_run.add(r.aid)           # the controller releases the backend slot
                self._set_phase(r, "wait_eval")
        if trajectory is None:
            self.log.warning("rollout %s: %s", r.aid, failure)
            return self._infra(r, None, failure or "RUN failed")
        if trajectory.failure.kind == FailureKind.infra:
            self.log.warning("rollout %s: RUN: %s", r.aid, trajectory.failure.reason)
            return self._infra(r, trajectory, trajectory.failure.reason or "RUN: infrastructure failure")
        if trajectory.failure.kind == FailureKind.config:  # not the policy's doing: nothing to score
            return self._config_failure(r, trajectory, trajectory.failure.reason)

        # ---- EVAL: score (agent failures too: a legitimate reward)
        if self._eval_takes_sandbox and not self._eval_pool.locked():
            r.eval_sandbox = self._start_sandbox()
        t_wait = time.monotonic()
        reward: Any = None
        async with self._eval_pool:
            self._set_phase(r, "eval")
            r.stamps["eval"] = time.time()
            t0 = time.monotonic()
            r.waits["eval"] = t0 - t_wait
            try:
                kwargs: dict[str, Any] = {}
                if r.eval_sandbox is not None:
                    pre = r.eval_sandbox

                    async def fresh() -> Any:
                        return await asyncio.shield(pre)  # closed in _close if EVAL is cut short

                    kwargs["sandbox_factory"] = fresh
                async with asyncio.timeout(timeouts.eval_seconds):
                    reward = await handler.eval(task, r.sandbox, trajectory, **kwargs)
                value = float(reward.value if hasattr(reward, "value") else reward)
                if not math.isfinite(value):
                    raise EvalError(f"EVAL returned a non-finite reward {value!r}")
            except TimeoutError:
                failure = f"EVAL exceeded {timeouts.eval_seconds:g}s"
            except (EvalError, SandboxError) as e:
                failure = f"EVAL: {type(e).__name__}: {e}"
            except Exception as e:  # noqa: BLE001 - the evaluator crashed: infrastructure, never reward 0
                failure = f"EVAL crashed: {type(e).__name__}: {e}"
            finally:
                r.timings["eval"] = time.monotonic() - t0
        if failure is not None:
            self.log.warning("rollout %s: %s", r.aid, failure)
            return self._infra(r, trajectory, failure)
        details = dict(getattr(reward, "details", None) or {})
        trajectory.reward = value
        trajectory.reward_details = {**trajectory.reward_details, **details}
        return self._finish(r, trajectory)

    async def _init(self, r: Rollout) -> None:
        if self._needs_sandbox:
            per_task = getattr(self._handler, "sandbox_spec", None)  # e.g. harbor: the task's own image
            if per_task is not None:
                spec = await per_task(r.lease.task, self._sandbox_spec)
                r.sandbox = await self._create_sandbox(lambda: self._runtime.create(spec))
            else:
                r.sandbox = await self._create_sandbox()
        await self._handler.init(r.lease.task, r.sandbox)

    def _start_sandbox(self) -> asyncio.Task:
        """A sandbox for one rollout: from the warm pool (a fresh, already-started one), or created cold."""
        return self._spawn(self._pool.acquire())

    async def _create_sandbox(self, create: Any = None) -> Any:
        """A new sandbox (`create()`, default the warm pool). Its start-up is never cancelled half-way
        (rolloutd.sandbox would leave its directory behind): if cancelled meanwhile, it is closed once up."""
        task = self._spawn(create()) if create is not None else self._start_sandbox()
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._spawn(_close_pending(task))
            raise

    def _task_id(self, task: dict) -> str | None:
        try:
            return self._handler.task_id(task)
        except Exception:  # noqa: BLE001 - a task without the id field
            return None

    def _finish(self, r: Rollout, t: Trajectory) -> Trajectory:
        """Fill what the node knows better than the handler: identity, backend, timings."""
        lease = r.lease
        t.job, t.prompt, t.sample, t.attempt = self.opts.job, lease.prompt, lease.sample, lease.attempt
        t.node, t.backend, t.policy_version = self.name, r.backend, lease.policy_version
        if r.llm is not None and r.llm.versions:  # the versions that actually generated each turn
            t.policy_versions = [v for v in r.llm.versions if v is not None]
            t.policy_version = r.llm.versions[0] if r.llm.versions[0] is not None else lease.policy_version
        if t.task_id is None:
            t.task_id = self._task_id(lease.task)
        t.timings = Timings(queue=lease.queued_seconds, init=r.timings.get("init", 0.0),
                            run=r.timings.get("run", 0.0), eval=r.timings.get("eval", 0.0),
                            stamps={**r.stamps, "end": time.time()})
        t.metrics = {**t.metrics, **{f"node_wait_{k}_seconds": round(v, 6) for k, v in r.waits.items()}}
        return t

    def _infra(self, r: Rollout, t: Trajectory | None, reason: str) -> Trajectory:
        """An infrastructure failure: reported, never a reward."""
        self.stats["infra"] += 1
        if t is None:
            t = Trajectory(job=self.opts.job, prompt=r.lease.prompt, sample=r.lease.sample)
        t.reward = None
        t.failure = Failure(kind=FailureKind.infra, reason=reason[:2000])
        if t.finish_reason is None:
            t.finish_reason = "error"
        return self._finish(r, t)

    async def _report_config(self, reason: str) -> None:
        """The job's spec cannot work here (its tokenizer does not load): report that on one leased
        rollout, as its first rollout would, so the controller fails the job instead of daemons
        being started again and again."""
        try:
            resp = await self.client.lease(self.node_id, LeaseRequest(max_items=1, wait=self.opts.lease_wait))
        except ControllerError as e:
            self.log.warning("could not report the configuration error: %s", e)
            return
        for lease in resp.leases:
            r = Rollout(lease=lease, backend=lease.backend, leased_at=time.monotonic())
            self._submit(r, self._config_failure(r, None, reason))
        await self._flush_results()

    def _config_failure(self, r: Rollout, t: Trajectory | None, reason: str) -> Trajectory:
        """The job's configuration made the rollout impossible: reported unscored (the controller
        fails the job with `reason`, which names the spec field)."""
        self.stats["config"] += 1
        self.log.error("rollout %s: configuration: %s", r.aid, reason)
        if t is None:
            t = Trajectory(job=self.opts.job, prompt=r.lease.prompt, sample=r.lease.sample)
        t.reward = None
        t.failure = Failure(kind=FailureKind.config, reason=reason[:2000])
        t.finish_reason = t.finish_reason or "error"
        return self._finish(r, t)

    async def _close(self, r: Rollout) -> None:
        """Close the rollout's sandboxes; survives a second cancel (the close runs in its own task)."""
        closers = []
        if r.sandbox is not None:
            closers.append(r.sandbox.close())
        if r.eval_sandbox is not None:
            closers.append(_close_pending(r.eval_sandbox))
        if not closers:
            return
        task = self._spawn(asyncio.gather(*closers, return_exceptions=True))
        try:
            results = await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.wait([task], timeout=30)
            raise
        for res in results:
            if isinstance(res, BaseException):
                self.log.warning("rollout %s: closing a sandbox: %r", r.aid, res)

    def _spawn(self, aw: Any) -> asyncio.Task:
        task = asyncio.ensure_future(aw)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task

    # ------------------------------------------------------------------ cancellation
    def cancel(self, aid: str, why: str) -> bool:
        """Cancel a rollout now: its task (sandbox closed in its finally), its in-flight LLM
        requests aborted server-side, nothing reported. False when it is not here."""
        self._drop_result(aid)
        r = self._rollouts.get(aid)
        if r is None or r.silent or r.reported:
            return False
        r.silent = True
        self.stats["cancels"] += 1
        self.log.info("rollout %s: cancelled (%s) in phase %s", aid, why, r.phase)
        request_ids = sorted(r.llm.in_flight) if r.llm is not None else []
        if r.task is not None:
            r.task.cancel()
            # code below us may swallow a cancel (3.11's asyncio.wait_for does when the awaited
            # reply lands at the same moment): insist until the rollout reaches its clean-up
            # (every 2 s: longer than a sandbox close a handler may be doing in its own finally)
            self._spawn(_insist_cancel(r.task, lambda: not r.closing, interval=2.0))
        for rid in request_ids:
            self._spawn(self._abort(r.llm, rid))
        self._changed(stage=True)
        return True

    async def _abort(self, llm: TrackedLLM, request_id: str) -> None:
        try:
            async with asyncio.timeout(15.0):
                await llm.abort(request_id)
            self.stats["aborts"] += 1
        except Exception as e:  # noqa: BLE001 - best effort; the backend may be gone
            self.log.warning("abort of LLM request %s failed: %r", request_id, e)

    async def _cancel_all(self, why: str, rollouts: list[Rollout] | None = None) -> list[str]:
        victims = [r for r in (rollouts if rollouts is not None else list(self._rollouts.values()))]
        ids = [r.aid for r in victims if self.cancel(r.aid, why)]
        tasks = [r.task for r in victims if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=60)
        if self._bg:
            await asyncio.wait(list(self._bg), timeout=30)
        return ids

    # ------------------------------------------------------------------ heartbeats
    async def _heartbeat_loop(self) -> None:
        while True:
            await _wait_event(self._hb_wake, self._hb_interval)
            least = max(self.opts.heartbeat_min_gap, heartbeat_min_gap(self._hb_interval))
            gap = self._last_hb + least - time.monotonic()
            if gap > 0:
                await asyncio.sleep(gap)   # coalesce a burst of stage changes into one beat
            self._hb_wake.clear()
            await self._beat()

    async def _beat(self) -> None:
        assert self.node_id is not None
        stages = {aid: WIRE_STAGE[r.phase] for aid, r in self._rollouts.items() if not (r.silent or r.reported)}
        for aid in self._outbox:  # finished, result not acknowledged yet: keep the lease alive
            stages.setdefault(aid, "eval")
        left = set(self._left_run)
        self._last_hb = time.monotonic()
        try:
            resp = await self.client.heartbeat(self.node_id, Heartbeat(
                stages=stages, left_run=sorted(left), llm_inflight=self.gate.inflight,
                llm_held=self.gate.paused, policy_version=self.gate.version))
        except ControllerError as e:
            self.stats["heartbeat_failures"] += 1
            if e.gone:
                self._fatal = f"heartbeat: {e}"
                self._changed()
            else:
                self.log.warning("heartbeat: %s", e)
            return
        self.stats["heartbeats"] += 1
        self._left_run -= left
        self._apply(resp)

    def _apply(self, resp: HeartbeatResponse) -> None:
        self._lease_seconds = resp.lease_seconds
        if resp.llm_paused != self.gate.paused or resp.policy_version != self.gate.version:
            self.log.info("policy version %s%s", resp.policy_version, " (LLM calls held)" if resp.llm_paused else "")
        self.gate.set(resp.policy_version, resp.llm_paused)
        for aid in resp.cancel:
            self.cancel(aid, "cancelled by the controller")
        for aid in resp.unknown:
            self.cancel(aid, "the controller no longer leases it to this node")
        for aid, url in resp.repin.items():
            r = self._rollouts.get(aid)
            if r is not None and r.phase in ("leased", "init", "wait_run"):
                self.log.info("rollout %s: backend %s → %s", aid, r.backend, url)
                r.backend = url
        if resp.drain:
            self._start_drain("the controller asked this node to drain")

    # ------------------------------------------------------------------ results
    def _submit(self, r: Rollout, t: Trajectory) -> None:
        r.reported = True
        self._outbox[r.aid] = _Outgoing(result_json(Result(attempt_id=r.aid, trajectory=t)), r.lease)
        self.stats["finished"] += 1
        self._outbox_event.set()

    def _drop_result(self, aid: str) -> None:
        """Forget an undelivered result (cancelled, or the controller no longer leases it)."""
        if self._outbox.pop(aid, None) is not None:
            self.log.info("result %s not sent: the controller cancelled or forgot the attempt", aid)
            self._changed()

    async def _result_loop(self) -> None:
        backoff = Backoff(0.1, self.opts.retry_max)
        while True:
            await self._outbox_event.wait()
            await asyncio.sleep(self.opts.result_coalesce)
            self._outbox_event.clear()
            if not await self._send_results():
                await asyncio.sleep(backoff.next())
                self._outbox_event.set()
            else:
                backoff.reset()
                if self._outbox:
                    self._outbox_event.set()

    def _next_batch(self) -> list[tuple[str, bytes]]:
        batch: list[tuple[str, bytes]] = []
        size = 0
        for aid, out in self._outbox.items():
            body = out.body
            if batch and (len(batch) >= self.opts.result_batch or size + len(body) > self.opts.result_batch_bytes):
                break
            batch.append((aid, body))
            size += len(body) + 1
        return batch

    async def _send_results(self) -> bool:
        """Send one batch; False when the controller could not be reached (the batch stays)."""
        assert self.node_id is not None
        batch = self._next_batch()
        if not batch:
            return True
        try:
            ack = await self.client.results(self.node_id, [body for _, body in batch])
        except ControllerError as e:
            self.stats["result_failures"] += 1
            if e.retryable:
                self.log.warning("results: %s; %d result(s) kept for a retry", e, len(self._outbox))
                return False
            if e.status == 413 and len(batch) > 1:
                # too large together: send them one by one (each alone may still fit)
                self.log.warning("results: %d result(s) too large as one batch; sending them singly", len(batch))
                return await self._send_singly(batch)
            for aid, body in batch:
                self._refused(aid, body, e)
            return True
        self._acked([aid for aid, _ in batch], ack)
        return True

    async def _send_singly(self, batch: list[tuple[str, bytes]]) -> bool:
        for aid, body in batch:
            try:
                ack = await self.client.results(self.node_id, [body])
            except ControllerError as e:
                self.stats["result_failures"] += 1
                if e.retryable:
                    return False
                self._refused(aid, body, e)
                continue
            self._acked([aid], ack)
        return True

    def _refused(self, aid: str, body: bytes, error: ControllerError) -> None:
        """The controller refuses a result for good (too large, invalid): report the attempt as an
        infrastructure failure instead, so the item is retried or given up, never stuck leased.
        A refused stand-in is dropped."""
        self.stats["results_refused"] += 1
        out = self._outbox.get(aid)
        if out is None:
            return
        if out.stub:
            self.log.error("result %s refused again (%s); dropping it", aid, error)
            self._outbox.pop(aid, None)
            self._changed()
            return
        self.log.error("result %s refused (%s, %d bytes); reporting an infrastructure failure instead",
                       aid, error, len(body))
        lease = out.lease
        stub = Trajectory(job=self.opts.job, prompt=lease.prompt, sample=lease.sample, attempt=lease.attempt,
                          task_id=self._task_id(lease.task),
                          node=self.name, backend=lease.backend, policy_version=lease.policy_version,
                          finish_reason="error",
                          failure=Failure(kind=FailureKind.infra,
                                          reason=f"the controller refused the result ({len(body)} bytes): {error}"[:2000]))
        self._outbox[aid] = _Outgoing(result_json(Result(attempt_id=aid, trajectory=stub)), lease, stub=True)
        self._outbox_event.set()

    def _acked(self, aids: list[str], ack: Any) -> None:
        self.stats["result_batches"] += 1
        for aid in aids:
            # a result cancelled after it was sent is gone from the outbox already
            self._outbox.pop(aid, None)
        if ack is not None:
            self.stats["results_accepted"] += len(ack.accepted)
            for aid, why in ack.dropped.items():
                self.stats["results_dropped"] += 1
                self.log.info("result %s dropped by the controller: %s", aid, why)
        self._changed()

    async def _flush_results(self) -> None:
        deadline = time.monotonic() + self.opts.flush_seconds
        backoff = Backoff(0.1, min(2.0, self.opts.retry_max))
        while self._outbox and time.monotonic() < deadline:
            if not await self._send_results():
                await asyncio.sleep(min(backoff.next(), max(deadline - time.monotonic(), 0)))
        if self._outbox:
            self.log.error("could not deliver %d result(s): %s", len(self._outbox), sorted(self._outbox))

    # ------------------------------------------------------------------ shutdown
    async def _give_back(self, attempt_ids: list[str], reason: str) -> None:
        if not attempt_ids or self.node_id is None:
            return
        backoff = Backoff(0.1, 1.0)
        deadline = time.monotonic() + 10.0
        while True:
            try:
                await self.client.give_back(self.node_id, ReturnRequest(attempt_ids=attempt_ids, reason=reason))
                self.stats["returned"] += len(attempt_ids)
                self.log.info("handed back %d lease(s): %s", len(attempt_ids), reason)
                return
            except ControllerError as e:
                if not e.retryable or time.monotonic() > deadline:
                    self.log.warning("return of %s failed (%s); the leases will expire", attempt_ids, e)
                    return
                await asyncio.sleep(backoff.next())

    def _in_flight(self) -> list[Rollout]:
        """Rollouts still working towards a result (not cancelled, not reported yet)."""
        return [r for r in self._rollouts.values() if not (r.silent or r.reported)]

    async def _shutdown(self) -> None:
        # 1. no more leasing; a long-poll in flight may still bring leases (handed back unstarted)
        if self._lease_task is not None and not self._lease_task.done():
            self._room.set()
            await asyncio.wait([self._lease_task], timeout=self.opts.lease_wait + 10.0)
            self._lease_task.cancel()
        # 2. hand back every lease not started yet
        unstarted = [r for r in self._rollouts.values() if r.phase == "leased" and not r.silent]
        for r in unstarted:
            self.cancel(r.aid, "node shutting down before it started")
        await self._give_back([r.aid for r in unstarted], "node shutting down: not started")
        # 3. the grace period: in-flight rollouts finish and report
        live = self._in_flight()
        if live:
            self.log.info("waiting up to %gs for %d in-flight rollout(s)", self.opts.drain_seconds, len(live))
            deadline = time.monotonic() + self.opts.drain_seconds
            while self._in_flight() and not self._hard_stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._wake.clear()
                waiters = [asyncio.ensure_future(self._wake.wait()), asyncio.ensure_future(self._hard_event.wait())]
                await asyncio.wait(waiters, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                for w in waiters:
                    w.cancel()
        # 4. the rest: cancel (sandboxes closed, LLM requests aborted) and hand back
        rest = self._in_flight()
        if rest:
            self.log.warning("grace period over: cancelling %d rollout(s)", len(rest))
            ids = await self._cancel_all("node shutting down: grace period over", rest)
            await self._give_back(ids, "node shutting down: grace period over")
        else:
            await self._cancel_all("node shutting down", list(self._rollouts.values()))

    async def _deregister(self) -> None:
        if self.node_id is None:
            return
        try:
            await self.client.deregister(self.node_id)
            self.log.info("deregistered")
        except ControllerError as e:
            self.log.warning("deregister: %s", e)

    async def _sleep_unless_stopped(self, seconds: float) -> None:
        await _wait_event(self._stop_event, seconds)


@dataclass
class _Outgoing:
    body: bytes          # the Result's wire JSON, serialized once
    lease: Lease
    stub: bool = False   # a stand-in infra failure for a result the controller refused


class _Infra(Exception):
    """An infrastructure problem found by the node itself (reported as `infra`)."""


async def _insist_cancel(task: asyncio.Task, still: Callable[[], bool] = lambda: True, *,
                         interval: float = 0.2, timeout: float | None = None) -> None:
    """Cancel `task` again every `interval` s while `still()` holds, until it is done."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not task.done():
        if still():
            task.cancel()
        if deadline is not None and time.monotonic() >= deadline:
            return
        await asyncio.wait([task], timeout=interval)


async def _wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait for `event` at most `timeout` s. (Not `asyncio.wait_for`: on 3.11 it can swallow a
    cancellation that arrives as the event fires, and the loop calling it would never stop.)"""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
        return True
    except TimeoutError:
        return False


async def _close_pending(task: asyncio.Task) -> None:
    """Close a sandbox that is being (or was) created in the background, once it is up."""
    try:
        sandbox = await asyncio.shield(task)
    except asyncio.CancelledError:
        if not task.done():  # we were cancelled, not the creation: let it finish elsewhere
            asyncio.get_running_loop().create_task(_close_pending(task))
        raise
    except Exception:  # noqa: BLE001 - creation failed: nothing to close
        return
    await sandbox.close()


async def run_node(options: NodeOptions, **seams: Any) -> int:
    """Run a daemon with SIGTERM/SIGINT handled; the exit code."""
    return await NodeDaemon(options, install_signals=True, **seams).run()
