"""The node daemon's lifecycle (`rolloutd node`): register, set the job up, run the loops, leave in a `Shutdown` way.

Next: lease.py pulls work → pipeline.py runs INIT → RUN → EVAL → outbox.py reports; heartbeat.py carries stages,
cancels and drains; rollouts.py holds what is live; jobconfig.py reads the spec once, options.py the environment;
firstwave.py paces a job's first wave to the warm pool.
Started per allocated node by Slurm (`srun`) or the local executor, from agents/cli.py; it never touches SQLite.

Leaving: SIGTERM stops leasing, hands back unstarted leases, lets in-flight rollouts finish for `drain_seconds`,
cancels and hands back the rest, exit 0 (a second signal a second or more later ends the grace period); the
controller's drain or "no more work": finish in flight, exit 0; a controller that forgot the node, or has not
answered for 20 × leaseSeconds + 60 s (heartbeat.py): cancel everything, end the sandboxes, exit 1.
Test seams (keyword arguments): `client`, `handler`, `llm_factory(url)`, `tokenizer`, `sandbox_runtime`; what
happened: `rollouts.transitions` (monotonic time, attemptId, phase) and `stats` (counts).
"""
from __future__ import annotations

import asyncio
import collections
import enum
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from rolloutd.crds.node import (
    BEAT_DELTAS,
    BEAT_RESULTS,
    BEAT_TURNS,
    POLICY_WATCH,
    NODE_PROTOCOL,
    Lease,
    RegisterRequest,
    RegisterResponse,
    TOKEN_SHARE,
    WEIGHT_STAMPS,
    WORK_SHARE,
    result_coalesce,
)

from rolloutd.crds.kit.aiokit import Backoff, wait_event
from ..llm import LLMBackend
from ..tasks.base import TaskHandler
from .controller_client import ControllerClient, ControllerError
from .fit import check_fit
from .heartbeat import Heartbeater, unreachable_after
from .jobconfig import JobConfig, load_spec
from .lease import UNSTARTED, Leaser
from .policygate import PolicyGate
from .options import NodeError, NodeOptions
from .outbox import Outbox
from .pipeline import Pipeline
from .policywatch import PolicyWatcher
from .rollouts import Phase, Rollout, Rollouts, insist_cancel
from .supervise import EXIT_REFUSED

log = logging.getLogger("rolloutd.node")

SAME_SIGNAL_SECONDS = 1.0  # a second SIGTERM sooner than this is a duplicate, not "hurry"


class Shutdown(enum.IntEnum):
    """How far the daemon is on its way out. It only moves up: a later, stronger reason wins."""

    RUNNING = 0    # leasing
    DRAINING = 1   # the controller asked this node to drain: finish in-flight rollouts, exit 0
    DONE = 2       # the controller has no more work for this node: the same
    LOST = 3       # the controller no longer knows this node: cancel everything, exit 1 (0: its job was released)
    STOPPING = 4   # SIGTERM/SIGINT: hand back, drain for `drain_seconds`, exit 0
    HURRY = 5      # a second signal: the grace period is over


class _NodeLog(logging.LoggerAdapter):
    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[{self.extra['node']}] {msg}", kwargs


class NodeDaemon:
    """One node's daemon. `await run()` returns the exit code; `request_stop()` is SIGTERM."""

    def __init__(self, options: NodeOptions, *, client: ControllerClient | None = None,
                 handler: TaskHandler | None = None, llm_factory: Callable[[str], LLMBackend] | None = None,
                 tokenizer: Any = None, sandbox_runtime: Any = None, install_signals: bool = False) -> None:
        self.opts = options
        self.name = options.name
        self.log = _NodeLog(log, {"node": options.name})
        self.client = client or ControllerClient(options.controller, options.token, job=options.job,
                                                    ca_file=options.ca_file)
        self._owns_client = client is None
        self._handler, self._llm_factory, self._tokenizer = handler, llm_factory, tokenizer
        self._runtime = sandbox_runtime
        self._install_signals = install_signals

        self.state = Shutdown.RUNNING
        self.reason = ""                      # why `state` was reached (logged at exit)
        self._stop_requested_at: float | None = None
        self._wake = asyncio.Event()          # `_supervise` re-checks its exit conditions
        self._stop_event = asyncio.Event()    # SIGTERM: back-off sleeps end at once

        self.node_id: str | None = None
        self.registration: RegisterResponse | None = None
        self.config: JobConfig | None = None
        self.pipeline: Pipeline | None = None
        self.stats: collections.Counter[str] = collections.Counter()
        self.gate = PolicyGate()
        self.outbox = Outbox(self.client, options, self.log, self.stats, self._changed,
                             stand_in=lambda lease, reason: self.config.stand_in(lease, reason))
        self.rollouts = Rollouts(self.log, self.stats, self._changed, drop_result=self.outbox.drop)
        self.heart = Heartbeater(self.client, options, self.log, self.stats, self.rollouts, self.outbox, self.gate,
                                 on_gone=self._lost, on_drain=self._start_drain)
        self.gate.on_change = self.heart.gate_changed
        self.leaser = Leaser(self.client, options, self.log, self.stats,
                             leasing=lambda: self.state is Shutdown.RUNNING,
                             stopping=lambda: self.state >= Shutdown.STOPPING,
                             room=lambda: self.pipeline.room(), start=self._start, on_gone=self._lost,
                             on_done=lambda: self._reach(Shutdown.DONE, "the job is done"),
                             on_drain=self._start_drain, stop_event=self._stop_event)
        self.heart.leaser = self.outbox.leaser = self.leaser  # leases ride on beats' and results' replies
        self.outbox.beat_soon = self.heart.wake.set               # results ride on beats (beat-results)
        self.leaser.want_beat = self.heart.wake.set
        self._loops: list[asyncio.Task] = []
        self._lease_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ state
    def _changed(self, *, stage: bool = False) -> None:
        self._wake.set()
        self.leaser.room.set()
        if stage:
            self.heart.wake.set()

    def _reach(self, state: Shutdown, reason: str) -> None:
        if state > self.state:
            self.state, self.reason = state, reason
        self._changed()

    def _lost(self, reason: str) -> None:
        self._reach(Shutdown.LOST, reason)

    def _start_drain(self, why: str) -> None:
        if self.state < Shutdown.DRAINING:
            self.log.info("%s: no more leasing, finishing in-flight rollouts", why)
        self._reach(Shutdown.DRAINING, "drained")

    def request_stop(self, why: str = "SIGTERM") -> None:
        """Begin the graceful shutdown (what SIGTERM does); a second call skips the grace period.

        A second call within `SAME_SIGNAL_SECONDS` is the same stop delivered twice — Slurm signals
        every process of a step, so a daemon under `--restarts` gets it directly and forwarded by
        its supervisor — and is ignored."""
        if self._stop_requested_at is not None:
            if time.monotonic() - self._stop_requested_at < SAME_SIGNAL_SECONDS:
                return
            if self.state < Shutdown.HURRY:
                self.log.warning("%s again: cancelling in-flight rollouts now", why)
            self._reach(Shutdown.HURRY, why)
            return
        self.log.info("%s: stop leasing, hand back unstarted work, drain in-flight rollouts", why)
        self._stop_requested_at = time.monotonic()
        self._stop_event.set()
        self._reach(Shutdown.STOPPING, why)

    # ------------------------------------------------------------------ main
    async def run(self) -> int:
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
                await self._set_up()
            except NodeError as e:
                self.log.error("%s", e)
                if e.config and self.node_id is not None:
                    await self._report_config(e.config)
                if self.node_id is not None:
                    await self._deregister()
                return EXIT_REFUSED  # a restart cannot help (supervise.py does not retry it)
            self._lease_task = asyncio.create_task(self._lease_loop(), name="lease")
            self._loops += [self._lease_task, asyncio.create_task(self.outbox.loop(), name="results")]
            state = await self._supervise()
            code = 0
            if state >= Shutdown.STOPPING:
                await self._shutdown()
            elif state is Shutdown.LOST:
                # a revoked node token: the job was released (it finished, or was deleted): a clean end
                released = getattr(self.client, "revoked", False)
                if released:
                    self.log.info("the job was released (its node credential revoked): exiting")
                else:
                    self.log.error("%s", self.reason)
                await self.rollouts.cancel_all("the controller no longer knows this node")
                code = 0 if released else 1
            else:
                self.log.info("%s and nothing in flight: exiting", self.reason)
            await self.outbox.flush()
            if self.rollouts.left_run and self.state is not Shutdown.LOST:
                await self.heart.beat()    # the last attempts that left RUN: their backend slots
            for task in self._loops:  # no heartbeat after deregistering
                await insist_cancel(task, timeout=10)
            await self._deregister()
            return code
        finally:
            await self._close(loop, signals)

    async def _close(self, loop: asyncio.AbstractEventLoop, signals: list[int]) -> None:
        """Every way out: nothing of ours left running."""
        tasks = [r.task for r in self.rollouts.live.values() if r.task is not None]
        for task in (*self._loops, *tasks):
            task.cancel()
        pending = [*self._loops, *tasks]
        if pending:
            await asyncio.wait(pending, timeout=30)
        if self.rollouts.background:
            await asyncio.wait(list(self.rollouts.background), timeout=30)
        if self.pipeline is not None:  # done, drain, SIGTERM, lost: no warm sandbox left
            await self.pipeline.aclose()
        if self._owns_client:
            await self.client.aclose()
        for sig in signals:
            # From here on the daemon is exiting with its code: a late SIGTERM (Slurm's scancel
            # racing a daemon that already finished) must not turn exit 0 into "killed by signal"
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)

    async def _supervise(self) -> Shutdown:
        """Wait until the daemon must leave; the state that says how."""
        while True:
            if self.state >= Shutdown.LOST:
                return self.state
            if self.state is not Shutdown.RUNNING and not self.rollouts.live and not self.outbox.pending \
                    and self._lease_task is not None and self._lease_task.done():
                return self.state
            await self._wake.wait()
            self._wake.clear()

    # ------------------------------------------------------------------ registration and set-up
    async def _register(self) -> bool:
        o = self.opts
        req = RegisterRequest(job=o.job, protocol=NODE_PROTOCOL, name=o.name, host=o.host, pid=o.pid,
                              slurm_job_id=o.slurm_job_id, slurm_node_id=o.slurm_node_id, slot=o.slot)
        backoff = Backoff(0.2, o.retry_max)
        deadline = time.monotonic() + o.register_timeout
        while True:
            if self._stop_requested_at is not None:
                return False
            try:
                resp = await self.client.register(req, features=o.features)
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
                await wait_event(self._stop_event, backoff.next())
        self.registration = resp
        self.node_id = self.outbox.node_id = self.heart.node_id = self.leaser.node_id = resp.node_id
        self.heart.interval = max(resp.heartbeat_seconds, 0.05)
        self.heart.reached = time.monotonic()  # the controller's silence is counted from here
        self.outbox.coalesce = max(o.result_coalesce, result_coalesce(resp.heartbeat_seconds))
        served = set(resp.features or ()) & set(o.features)
        self.outbox.on_beats = BEAT_RESULTS in served
        self.heart.deltas, self.heart.turns, self.heart.tokens = (f in served for f in (BEAT_DELTAS, BEAT_TURNS, TOKEN_SHARE))
        self.heart.work = WORK_SHARE in served
        self.heart.watcher = PolicyWatcher(self.client, resp.node_id, self.gate, self.log) if POLICY_WATCH in served else None
        self.gate.job_uid = resp.job_uid if WEIGHT_STAMPS in served else None  # labelled updates: exact stamps
        self.log.info("registered with %s as node %s for job %s (generation %s; features: %s)", o.controller,
                      resp.node_id, resp.job, resp.generation, ",".join(sorted(served)) or "none")
        return True

    async def _set_up(self) -> None:
        """The job's spec → `JobConfig` and `Pipeline`; the warm pool (it warms for the first wave while the
        tokenizer loads; `_close` closes it on every way out, a tokenizer that fails to load too); the tokenizer."""
        spec = load_spec(self.registration.spec)
        self.config = JobConfig.build(spec, job=self.opts.job, node=self.name, handler=self._handler,
                                      policy=self.registration.policy, policy_name=self.registration.policy_name,
                                      sandbox_settings=self.opts.sandbox)
        self.gate.mode = self.config.spec.policy.update_mode
        self.pipeline = Pipeline(self.config, self.rollouts, self.outbox, self.gate, log=self.log, stats=self.stats,
                                 llm_factory=self._llm_factory, runtime=self._runtime, tokenizer=self._tokenizer,
                                 sandbox_settings=self.opts.sandbox, wake_leasing=self.leaser.room.set)
        # beating while the tokenizer loads (1-9 s on a busy node): a silent node is declared lost
        self.heart.unreachable_after = unreachable_after(spec.pipeline.lease_seconds, self.opts.controller_start_seconds)
        self._loops = [asyncio.create_task(self.heart.loop(), name="heartbeat")]
        if self.heart.watcher is not None:
            self._loops.append(asyncio.create_task(self.heart.watcher.loop(), name="policy-watch"))
        self.config.check_policy()  # before any sandbox: a job stored before its policy tightened cannot exceed it
        self.pipeline.start()
        if self.pipeline.tokenizer is None:
            self.pipeline.tokenizer = await self._load_tokenizer(spec.llm.tokenizer, spec.agent.chat_template_kwargs)
            await check_fit(self.pipeline.tokenizer, spec, self.config.default_backend(), self.opts.job)
        w, sandboxed = self.pipeline.workers, self.config.needs_sandbox
        self.log.info("job %s: tasks %s, sandbox %s (%s, %d warm), pools init=%d run=%d eval=%d", self.opts.job,
                      spec.tasks.kind, spec.sandbox.runtime if sandboxed else "none", spec.sandbox.image,
                      spec.sandbox.warm if sandboxed else 0, w[Phase.INIT], w[Phase.RUN], w[Phase.EVAL])

    async def _load_tokenizer(self, path: str | None, template_kwargs: dict[str, Any]) -> Any:
        """In a thread: importing transformers and reading a tokenizer blocks for seconds.
        None: an agent without an LLM (oracle)."""
        if path is None:
            return None

        def load():
            from ..tokenizer import ChatTokenizer
            return ChatTokenizer(path, template_kwargs=template_kwargs)

        try:
            return await asyncio.to_thread(load)
        except Exception as e:  # noqa: BLE001 - a missing or unreadable tokenizer: nothing can run
            raise NodeError(f"cannot set up job {self.opts.job!r}: {type(e).__name__}: {e}",
                            config=f"spec.llm.tokenizer: cannot load {path!r}: {type(e).__name__}: {e}") from None

    async def _report_config(self, reason: str) -> None:
        """The job's spec cannot work here (its tokenizer does not load): report that on one leased
        rollout, as its first rollout would, so the controller fails the job instead of daemons
        being started again and again."""
        for lease in await self.leaser.lease_one():
            r = Rollout(lease=lease, backend=lease.backend, leased_at=time.monotonic())
            self.pipeline.report(r, self.pipeline.config_failure(r, None, reason))
        await self.outbox.flush()

    # ------------------------------------------------------------------ leasing
    async def _lease_loop(self) -> None:
        try:
            await self.leaser.loop()
        finally:
            self._changed()

    def _start(self, lease: Lease) -> None:
        self.rollouts.start(lease, lease.backend or self.config.default_backend(), self.pipeline.run)

    # ------------------------------------------------------------------ shutdown
    async def _shutdown(self) -> None:
        # 1. no more leasing; a long-poll in flight may still bring leases (handed back unstarted)
        if self._lease_task is not None and not self._lease_task.done():
            self.leaser.room.set()
            await asyncio.wait([self._lease_task], timeout=self.opts.lease_wait + 10.0)
            self._lease_task.cancel()
        # 2. hand back every lease not started yet
        unstarted = [r for r in self.rollouts.live.values() if r.phase is Phase.LEASED and not r.silent]
        for r in unstarted:
            self.rollouts.cancel(r.aid, "node shutting down before it started")
        await self.leaser.give_back([r.aid for r in unstarted], UNSTARTED)
        # 3. the grace period: in-flight rollouts finish and report (a second signal ends it)
        if self.rollouts.in_flight():
            self.log.info("waiting up to %gs for %d in-flight rollout(s)", self.opts.drain_seconds,
                          len(self.rollouts.in_flight()))
            deadline = time.monotonic() + self.opts.drain_seconds
            while self.rollouts.in_flight() and self.state < Shutdown.HURRY:
                self._wake.clear()
                if not await wait_event(self._wake, deadline - time.monotonic()):
                    break
        # 4. the rest: cancel (sandboxes closed, LLM requests aborted) and hand back
        rest = self.rollouts.in_flight()
        if rest:
            self.log.warning("grace period over: cancelling %d rollout(s)", len(rest))
            ids = await self.rollouts.cancel_all("node shutting down: grace period over", rest)
            await self.leaser.give_back(ids, "node shutting down: grace period over")
        else:
            await self.rollouts.cancel_all("node shutting down")

    async def _deregister(self) -> None:
        if self.node_id is None:
            return
        try:
            await self.client.deregister(self.node_id)
            self.log.info("deregistered")
        except ControllerError as e:  # `gone`: the job was released (its credential revoked), nothing to undo
            (self.log.info if e.gone else self.log.warning)("deregister: %s", "the job was released" if e.gone else e)


async def run_node(options: NodeOptions, **seams: Any) -> int:
    """Run a daemon with SIGTERM/SIGINT handled; the exit code."""
    return await NodeDaemon(options, install_signals=True, **seams).run()
