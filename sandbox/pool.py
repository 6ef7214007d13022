"""A warm pool: sandboxes started ahead of need, so a rollout's INIT gets one in ~1 ms; sized from the INIT rate.

Where it sits: the node daemon (`rolloutd.agents`) keeps one `WarmPool` per job (one `SandboxSpec`)
and calls ``await pool.acquire()``; each sandbox is started by ``runtime.create`` (`runtimes/base.py`).
Next: how many acquisitions a second the pool has seen is its own `Demand`; the node's cores bound the refill.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import time
from collections.abc import Callable

from ..crds.rolloutjob import SandboxSpec
from .runtimes.base import SandboxRuntime
from .sandbox import Sandbox

log = logging.getLogger("rolloutd.sandbox.pool")

BURST_GAP = 0.25     # s: acquisitions each this close to the one before form one burst
MEMORY = 60.0        # s: the largest burst seen this long ago still sizes the pool
MAX_IDLE = 64        # idle sandboxes at most, whatever the demand (spec.sandbox.warm's own bound)


class Demand:
    """The INIT rate as the pool sees it: the largest burst over the last `memory` seconds, a burst being a run
    of acquisitions each within `gap` of the one before (a daemon's own work spreads the acquisitions of
    one burst over ~3 ms each, much more on a loaded node: a fixed window would cut the burst), at most
    `cap` (more could not raise the pool's size anyway)."""

    def __init__(self, cap: int, memory: float = MEMORY, gap: float = BURST_GAP) -> None:
        self.memory, self.gap = memory, gap
        self._at: collections.deque[float] = collections.deque(maxlen=max(1, cap) * 4)
        self._cap = cap

    def note(self, n: int = 1) -> None:
        now = time.monotonic()
        self._at.extend([now] * n)

    def peak(self) -> int:
        now = time.monotonic()
        while self._at and now - self._at[0] > self.memory:
            self._at.popleft()
        best, run, last = 0, 0, None
        for t in self._at:
            run = run + 1 if last is not None and t - last <= self.gap else 1
            best, last = max(best, run), t
        return min(best, self._cap)

    def next_change(self) -> float | None:
        """Seconds until the oldest remembered acquisition is forgotten (the peak may then fall)."""
        return max(0.0, self._at[0] + self.memory - time.monotonic()) if self._at else None


def default_max_idle(wall_seconds: float | None) -> float | None:
    """How long a sandbox may wait in the pool: 10 % of its wall time, within [5, 60] s (None: forever)."""
    if not wall_seconds:
        return None
    return min(60.0, max(5.0, wall_seconds * 0.1))


class WarmPool:
    """`size` or more started, idle sandboxes of one `spec`; `acquire` hands one out (or creates one).

        pool = WarmPool(get_runtime("bwrap"), SandboxSpec(), size=2, most=32)
        pool.start()                 # begin warming (needs a running event loop; acquire() starts it too)
        sb = await pool.acquire()    # a started, never-used sandbox: the caller owns it and closes it
        ...
        await pool.close()           # idle sandboxes closed, a creation in progress closed once it is up

    * A sandbox is handed out once and never taken back (each rollout gets a fresh one).
    * Before one is handed out it is checked cheaply (no round trip): its runtime process is
      running and not a zombie, and the exec server still holds its end of the connection (a dead
      server's socket reports a hang-up). A dead idle sandbox is closed (cleaned up), never handed out.
    * Sized from the INIT rate when given `most`: the pool keeps `target` idle sandboxes, the largest
      burst of acquisitions over the last minute (`Demand`), at least `size` and at
      most `MAX_IDLE`. A burst of N INITs thus finds N warm sandboxes once the pool has seen such a
      burst (a DAPO refill, the next wave of a job), and the pool shrinks back to `size` a minute after
      the bursts stop (the extra idle ones are closed). `most` bounds every sandbox of the pool alive at
      once (idle, being started, handed out and not yet closed): the node daemon passes what the tenant's
      quota admitted (init + run + eval + warm), so warming never makes a node hold more. Without `most`
      the pool is fixed: `size` idle sandboxes, however many are out.
    * Refill runs in one background task, up to `parallel` creations at once (default: the node's
      cores), and never while acquisitions are creating cold (the cores are theirs then: a refill
      would only slow them). A creation that fails is logged and retried with back-off; `acquire`
      then simply creates one cold and raises that creation's error as usual.
    * Wall time: a sandbox's wall clock starts when it is created, not when it is handed out. Idle
      sandboxes older than `max_idle` are recycled (closed and replaced), and pooled sandboxes are
      created with ``wall_seconds + max_idle``, so a rollout always gets at least the spec's wall time
      (at most `max_idle` more). Cold ones get exactly the spec.
    * `size` 0 (or after `close`): `acquire` is a plain ``runtime.create(spec)`` (counted `cold`).
    * `on_created` (a plain callable given at construction, default none): called each time a refill creation
      ends, whether its sandbox went idle or it failed (`stats["failures"]`); the node daemon's first wave re-checks
      its room on it.
    """

    def __init__(self, runtime: SandboxRuntime, spec: SandboxSpec, size: int, *, most: int | None = None,
                 parallel: int | None = None, memory: float = MEMORY, max_idle: float | None = None,
                 backoff: tuple[float, float] = (0.5, 30.0), on_created: Callable[[], None] | None = None) -> None:
        self.runtime = runtime
        self.spec = spec
        self.size = max(0, int(size))
        self.most = None if most is None or not self.size else max(self.size, int(most))
        self.parallel = max(1, parallel or os.cpu_count() or 1)
        self.demand = Demand(MAX_IDLE if self.most else 0, memory)
        # None: derived from the wall time (`default_max_idle`); math.inf: never recycle
        wall = spec.limits.wall_seconds
        max_idle = default_max_idle(wall) if max_idle is None else max_idle
        self.max_idle = max_idle if max_idle is not None and math.isfinite(max_idle) else None
        extra = math.ceil(self.max_idle) if self.max_idle is not None and wall else 0
        longer = spec.limits.model_copy(update={"wall_seconds": wall + extra})
        self.warm_spec = spec.model_copy(update={"limits": longer}) if extra else spec
        self.stats: collections.Counter[str] = collections.Counter()  # warm, cold, dead, expired, shrunk, failures
        self._on_created = on_created  # a refill creation ended (idle or failed)
        self._backoff = backoff
        self._idle: collections.deque[tuple[Sandbox, float]] = collections.deque()  # (sandbox, created at)
        self._need: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._creating: set[asyncio.Task] = set()    # the refill's creations in progress
        self._cold = 0                                # acquisitions creating cold right now
        self._out: set[Sandbox] = set()               # handed out and still open (counted against `most`)
        self._closing: set[asyncio.Task] = set()     # closes of discarded sandboxes
        self._close_task: asyncio.Task | None = None
        self._closed = False
        self._seen_failures = 0
        self._delay = backoff[0]

    @property
    def idle(self) -> int:
        """Idle sandboxes ready to be handed out (not yet checked for liveness)."""
        return len(self._idle)

    @property
    def target(self) -> int:
        """How many idle sandboxes the pool keeps now: `size`, raised to the recent peak demand."""
        return max(self.size, self.demand.peak())

    @property
    def held(self) -> int:
        """Sandboxes of the pool alive now: idle, being started, handed out and not yet closed."""
        self._out = {sb for sb in self._out if sb.alive}
        return len(self._idle) + len(self._creating) + len(self._out)

    @property
    def closed(self) -> bool:
        return self._closed

    def expect(self, n: int) -> None:
        """A burst of `n` acquisitions is coming (a job's first wave on this node): warm for it as if it had
        been seen now (no effect on a fixed pool)."""
        if self.most is not None:
            self.demand.note(max(0, n))
            if self._need is not None:
                self._need.set()

    def start(self) -> None:
        """Begin warming in the background (idempotent; needs a running event loop)."""
        if self._loop_task is None and self.size and not self._closed:
            self._need = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._refill(), name="warm-pool")

    async def acquire(self) -> Sandbox:
        """A started sandbox nobody has used: an idle one if there is a live one, else a cold create."""
        if self.size and not self._closed:
            self.start()
            self.demand.note()
            self._need.set()
            while self._idle:
                sb, born = self._idle.popleft()
                self._need.set()
                why = self._unusable(sb, born)
                if why is None:
                    self.stats["warm"] += 1
                    self._handed(sb)
                    return sb
                self._discard(sb, why)
            self.stats["cold"] += 1
            self._cold += 1
            try:
                return self._handed(await self.runtime.create(self.spec))
            finally:
                self._cold -= 1
                self._need.set()  # the refill may go on
        self.stats["cold"] += 1
        return await self.runtime.create(self.spec)

    def _handed(self, sb: Sandbox) -> Sandbox:
        if self.most is not None:
            self._out = {o for o in self._out if o.alive}
            self._out.add(sb)
        return sb

    async def close(self) -> None:
        """Stop refilling and close every idle sandbox (and those being created, once they are up).
        Idempotent; a cancelled close still finishes in the background."""
        if self._close_task is None:
            self._closed = True
            self._close_task = asyncio.ensure_future(self._close())
        await asyncio.shield(self._close_task)

    # ------------------------------------------------------------------ internals
    def _unusable(self, sb: Sandbox, born: float) -> str | None:
        """Why `sb` must not be handed out (None: it is fine). Cheap: a /proc read and a poll()."""
        if sb.gone():
            return "dead"
        if self.max_idle is not None and time.monotonic() - born > self.max_idle:
            return "expired"
        return None

    def _discard(self, sb: Sandbox, why: str) -> None:
        self.stats[why] += 1
        if why == "dead":
            log.warning("warm sandbox %s died while idle (%s); closing it", sb.id, sb.died or "server gone")
        self._later(self._close_quietly(sb))

    @staticmethod
    async def _close_quietly(sb: Sandbox) -> None:
        try:
            await sb.close()
        except Exception as e:  # noqa: BLE001 - best effort; close() leaves nothing whatever happens
            log.warning("closing warm sandbox %s: %r", sb.id, e)

    async def _refill(self) -> None:
        try:
            await self._refill_loop()
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not go unnoticed; acquire() goes on creating cold
            log.exception("warm pool: the refill loop failed; sandboxes are now created on demand")

    async def _refill_loop(self) -> None:
        assert self._need is not None
        while not self._closed:
            for entry in list(self._idle):  # died or too old while idle: replace it
                why = self._unusable(*entry)
                if why is not None:
                    self._idle.remove(entry)
                    self._discard(entry[0], why)
            target = self.target
            while len(self._idle) > target:  # the bursts are over: back to size
                self._discard(self._idle.popleft()[0], "shrunk")
            missing = target - len(self._idle) - len(self._creating)
            if self.most is not None:
                missing = min(missing, self.most - self.held)
            if missing <= 0 or self._cold or len(self._creating) >= self.parallel:
                self._need.clear()
                await self._wait_for_need()
                continue
            # tasks of their own: a close() cancelling this loop must not cut a start half-way (close()
            # closes the sandbox once it is up); each stays in self._creating until `_created`
            for _ in range(min(missing, self.parallel - len(self._creating))):
                task = asyncio.ensure_future(self.runtime.create(self.warm_spec))
                self._creating.add(task)
                task.add_done_callback(self._created)
            await self._wait_for_need()
            if self.stats["failures"] > self._seen_failures:  # back off before trying again
                self._seen_failures = self.stats["failures"]
                await asyncio.sleep(self._delay)
                self._delay = min(self._delay * 2, self._backoff[1])
            elif self._idle:
                self._delay = self._backoff[0]

    def _created(self, task: asyncio.Task) -> None:
        """A refill creation ended: its sandbox goes idle (or is closed when the pool is), or it failed."""
        self._creating.discard(task)
        if task.cancelled():
            return
        e = task.exception()
        if e is not None:  # never raised into acquire(); it creates cold
            self.stats["failures"] += 1
            log.warning("warm pool: creating a sandbox failed (%s: %s); retrying in %.1fs",
                        type(e).__name__, e, self._delay)
        elif self._closed:
            self._later(self._close_quietly(task.result()))
        else:
            self._idle.append((task.result(), time.monotonic()))
        if self._need is not None:
            self._need.set()
        if self._on_created is not None:
            self._on_created()

    def _later(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _wait_for_need(self) -> None:
        """Until an acquire came, a creation ended, an idle sandbox died, one handed out ended, the oldest
        idle one is due for recycling or the remembered demand may fall."""
        waiters: list[asyncio.Future] = [asyncio.ensure_future(self._need.wait())]
        waiters += [sb.exited for sb, _ in self._idle]  # done when the sandbox's process exits
        waiters += [sb.exited for sb in self._out]       # one handed out closed: room under `most`
        due = []
        if self.max_idle is not None and self._idle:
            due.append(max(0.0, self._idle[0][1] + self.max_idle - time.monotonic()) + 0.01)
        if self.target > self.size and self.demand.next_change() is not None:
            due.append(self.demand.next_change() + 0.01)
        try:
            await asyncio.wait(waiters, timeout=min(due) if due else None, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiters[0].cancel()

    async def _close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.wait([self._loop_task])
        closers = [self._close_quietly(sb) for sb, _ in self._idle]
        self._idle.clear()
        creating = list(self._creating)  # each is closed once it is up (`_created`)
        if creating:
            await asyncio.wait(creating)
        if closers:
            await asyncio.gather(*closers)
        while self._closing:
            await asyncio.wait(list(self._closing))
