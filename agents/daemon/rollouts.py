"""The rollouts live on this node: each one's phase, sandboxes and LLM requests; starting, cancelling, counting room.

`lease.Leaser` adds rollouts, `pipeline.Pipeline` moves them through their phases, `heartbeat.Heartbeater`
reports their wire stages and cancels them on the controller's word.
"""
from __future__ import annotations

import asyncio
import collections
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rolloutd.crds.node import Lease

from .llmgate import TrackedLLM


class Phase(enum.StrEnum):
    """A rollout's phase on the node (finer than the wire's stage: the waits between pools count)."""

    LEASED = "leased"
    INIT = "init"
    WAIT_RUN = "wait_run"
    RUN = "run"
    WAIT_EVAL = "wait_eval"
    EVAL = "eval"
    GONE = "gone"


# phase (on the node) → stage (on the wire, `crds.node.Stage`)
WIRE_STAGE = {Phase.LEASED: "leased", Phase.INIT: "init", Phase.WAIT_RUN: "init", Phase.RUN: "run",
              Phase.WAIT_EVAL: "eval", Phase.EVAL: "eval"}


@dataclass(eq=False)
class Rollout:
    lease: Lease
    backend: str | None
    leased_at: float
    phase: Phase = Phase.LEASED
    task: asyncio.Task | None = None
    sandbox: Any = None
    eval_sandbox: asyncio.Task | None = None
    llm: TrackedLLM | None = None
    silent: bool = False          # cancelled / unknown / returned: report nothing
    reported: bool = False        # its result is in the outbox (the rollout is only closing up)
    closing: bool = False         # in its final clean-up (sandboxes being closed)
    timings: dict[str, float] = field(default_factory=dict)
    waits: dict[str, float] = field(default_factory=dict)
    stamps: dict[str, float] = field(default_factory=dict)   # epoch seconds each stage began

    @property
    def aid(self) -> str:
        return self.lease.attempt_id


class Rollouts:
    """Every rollout between its lease and its clean-up, by attemptId, and the background work they leave
    (aborts, sandbox closes). `transitions` records every (monotonic time, attemptId, phase)."""

    def __init__(self, log: logging.LoggerAdapter, stats: collections.Counter[str],
                 changed: Callable[..., None], drop_result: Callable[[str], None]) -> None:
        self.log, self.stats = log, stats
        self._changed = changed            # `changed(stage=True)`: a wire stage changed, beat soon
        self._drop_result = drop_result    # a cancelled rollout's result must not be sent
        self.live: dict[str, Rollout] = {}
        self.left_run: set[str] = set()    # left RUN, not reported to the controller yet (backend slots)
        self.background: set[asyncio.Task] = set()
        self.transitions: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=100_000)

    def start(self, lease: Lease, backend: str | None, work: Callable[[Rollout], Awaitable[None]]) -> None:
        if lease.attempt_id in self.live:
            self.log.warning("lease %s received twice; ignoring the copy", lease.attempt_id)
            return
        r = Rollout(lease=lease, backend=backend, leased_at=time.monotonic())
        self.live[r.aid] = r
        self.transitions.append((r.leased_at, r.aid, Phase.LEASED))
        self.stats["leased"] += 1
        r.task = asyncio.create_task(work(r), name=f"rollout-{r.aid}")
        self._changed(stage=True)

    def set_phase(self, r: Rollout, phase: Phase) -> None:
        old = WIRE_STAGE.get(r.phase)
        r.phase = phase
        self.transitions.append((time.monotonic(), r.aid, phase))
        self._changed(stage=WIRE_STAGE.get(phase) != old)

    def left(self, r: Rollout) -> None:
        """`r` left RUN: the controller releases its backend slot (told by the next heartbeat)."""
        self.left_run.add(r.aid)

    def remove(self, r: Rollout) -> None:
        self.live.pop(r.aid, None)
        self.transitions.append((time.monotonic(), r.aid, Phase.GONE))
        self._changed(stage=True)

    def room(self, init_workers: int, run_workers: int) -> int:
        """How many more leases fit: (leased + init) < init workers, and every rollout not in EVAL yet (leased,
        init, wait_run, run, wait_eval) < run workers + init workers. A full RUN pool thus keeps up to an INIT pool's
        worth of rollouts initialised and waiting, so a RUN slot that frees is taken at once, not after a lease round
        trip and an INIT (the engine would idle meanwhile); and a slow EVAL pool holds new work back once that many
        wait for it: a node's rollouts, each with its sandbox, are at most init + run + eval workers (uncounted, the
        rollouts waiting for EVAL piled up without bound, a sandbox and its workspace each)."""
        n = collections.Counter(r.phase for r in self.live.values())
        init_room = init_workers - n[Phase.LEASED] - n[Phase.INIT]
        ahead = n[Phase.LEASED] + n[Phase.INIT] + n[Phase.WAIT_RUN] + n[Phase.RUN] + n[Phase.WAIT_EVAL]
        return max(0, min(init_room, run_workers + init_workers - ahead))

    def in_flight(self) -> list[Rollout]:
        """Rollouts still working towards a result (not cancelled, not reported yet)."""
        return [r for r in self.live.values() if not (r.silent or r.reported)]

    def stages(self) -> dict[str, str]:
        """attemptId → wire stage of every rollout in flight (what a heartbeat carries)."""
        return {r.aid: WIRE_STAGE[r.phase] for r in self.in_flight()}

    def turns(self) -> dict[str, int]:
        """attemptId → turn (model calls started) of every rollout in RUN that called the model (beat-turns)."""
        return {r.aid: r.llm.calls for r in self.in_flight() if r.phase == Phase.RUN and r.llm is not None and r.llm.calls}

    def spawn(self, aw: Any) -> asyncio.Task:
        task = asyncio.ensure_future(aw)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return task

    # ------------------------------------------------------------------ cancellation
    def running_on(self, url: str) -> int:
        """The rollouts in RUN on the backend at `url` (the node's part of the job's token share there)."""
        return sum(1 for r in list(self.live.values()) if r.backend == url and r.phase is Phase.RUN)

    def cancel(self, aid: str, why: str) -> bool:
        """Cancel a rollout now: its task (sandbox closed in its finally), its in-flight LLM
        requests aborted server-side, nothing reported. False when it is not here."""
        self._drop_result(aid)
        r = self.live.get(aid)
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
            self.spawn(insist_cancel(r.task, lambda: not r.closing, interval=2.0))
        for rid in request_ids:
            self.spawn(self._abort(r.llm, rid))
        self._changed(stage=True)
        return True

    async def _abort(self, llm: TrackedLLM, request_id: str) -> None:
        try:
            async with asyncio.timeout(15.0):
                await llm.abort(request_id)
            self.stats["aborts"] += 1
        except Exception as e:  # noqa: BLE001 - best effort; the backend may be gone
            self.log.warning("abort of LLM request %s failed: %r", request_id, e)

    async def cancel_all(self, why: str, rollouts: list[Rollout] | None = None) -> list[str]:
        """Cancel `rollouts` (default: all) and wait for their clean-up; the attemptIds cancelled."""
        victims = list(rollouts if rollouts is not None else self.live.values())
        ids = [r.aid for r in victims if self.cancel(r.aid, why)]
        tasks = [r.task for r in victims if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=60)
        if self.background:
            await asyncio.wait(list(self.background), timeout=30)
        return ids


async def insist_cancel(task: asyncio.Task, still: Callable[[], bool] = lambda: True, *,
                        interval: float = 0.2, timeout: float | None = None) -> None:
    """Cancel `task` again every `interval` s while `still()` holds, until it is done."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not task.done():
        if still():
            task.cancel()
        if deadline is not None and time.monotonic() >= deadline:
            return
        await asyncio.wait([task], timeout=interval)
