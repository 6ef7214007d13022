"""A warm pool: sandboxes started ahead of need, so a rollout's INIT gets one in ~1 ms.

Where it sits: the node daemon (`rolloutd.agents`) keeps one `WarmPool` per job (one `SandboxSpec`)
and calls ``await pool.acquire()``; each sandbox is started by ``runtime.create`` (`runtimes/base.py`).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import math
import time

from ..crds.rolloutjob import SandboxSpec
from .runtimes.base import SandboxRuntime
from .sandbox import Sandbox

log = logging.getLogger("rolloutd.sandbox.pool")


def default_max_idle(wall_seconds: float | None) -> float | None:
    """How long a sandbox may wait in the pool: 10 % of its wall time, within [5, 60] s (None: forever)."""
    if not wall_seconds:
        return None
    return min(60.0, max(5.0, wall_seconds * 0.1))


class WarmPool:
    """Up to `size` started, idle sandboxes of one `spec`; `acquire` hands one out (or creates one).

        pool = WarmPool(get_runtime("bwrap"), SandboxSpec(), size=2)
        pool.start()                 # begin warming (needs a running event loop; acquire() starts it too)
        sb = await pool.acquire()    # a started, never-used sandbox: the caller owns it and closes it
        ...
        await pool.close()           # idle sandboxes closed, a creation in progress closed once it is up

    * A sandbox is handed out once and never taken back (each rollout gets a fresh one).
    * Before one is handed out it is checked cheaply (no round trip): its runtime process is
      running and not a zombie, and the exec server still holds its end of the connection (a dead
      server's socket reports a hang-up). A dead idle sandbox is closed (cleaned up), never handed out.
    * Refill runs in one background task, one creation at a time (it never competes with rollouts for
      the node's cores by more than one sandbox start), up to `size` idle sandboxes. A creation that
      fails is logged and retried with back-off; `acquire` then simply creates one cold and raises
      that creation's error as usual.
    * Wall time: a sandbox's wall clock starts when it is created, not when it is handed out. Idle
      sandboxes older than `max_idle` are recycled (closed and replaced), and pooled sandboxes are
      created with ``wall_seconds + max_idle``, so a rollout always gets at least the spec's wall time
      (at most `max_idle` more). Cold ones get exactly the spec.
    * `size` 0 (or after `close`): `acquire` is a plain ``runtime.create(spec)``.
    """

    def __init__(self, runtime: SandboxRuntime, spec: SandboxSpec, size: int, *,
                 max_idle: float | None = None, backoff: tuple[float, float] = (0.5, 30.0)) -> None:
        self.runtime = runtime
        self.spec = spec
        self.size = max(0, int(size))
        # None: derived from the wall time (`default_max_idle`); math.inf: never recycle
        wall = spec.limits.wall_seconds
        max_idle = default_max_idle(wall) if max_idle is None else max_idle
        self.max_idle = max_idle if max_idle is not None and math.isfinite(max_idle) else None
        extra = math.ceil(self.max_idle) if self.max_idle is not None and wall else 0
        longer = spec.limits.model_copy(update={"wall_seconds": wall + extra})
        self.warm_spec = spec.model_copy(update={"limits": longer}) if extra else spec
        self.stats: collections.Counter[str] = collections.Counter()  # warm, cold, dead, expired, failures
        self._backoff = backoff
        self._idle: collections.deque[tuple[Sandbox, float]] = collections.deque()  # (sandbox, created at)
        self._need: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._creating: asyncio.Task | None = None   # the refill's creation in progress
        self._closing: set[asyncio.Task] = set()     # closes of discarded sandboxes
        self._close_task: asyncio.Task | None = None
        self._closed = False

    @property
    def idle(self) -> int:
        """Idle sandboxes ready to be handed out (not yet checked for liveness)."""
        return len(self._idle)

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> None:
        """Begin warming in the background (idempotent; needs a running event loop)."""
        if self._loop_task is None and self.size and not self._closed:
            self._need = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._refill(), name="warm-pool")

    async def acquire(self) -> Sandbox:
        """A started sandbox nobody has used: an idle one if there is a live one, else a cold create."""
        if self.size and not self._closed:
            self.start()
            while self._idle:
                sb, born = self._idle.popleft()
                self._need.set()
                why = self._unusable(sb, born)
                if why is None:
                    self.stats["warm"] += 1
                    return sb
                self._discard(sb, why)
            self.stats["cold"] += 1
        return await self.runtime.create(self.spec)

    async def close(self) -> None:
        """Stop refilling and close every idle sandbox (and one being created, once it is up).
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
        task = asyncio.ensure_future(self._close_quietly(sb))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

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
        delay = self._backoff[0]
        while not self._closed:
            for entry in list(self._idle):  # died or too old while idle: replace it
                why = self._unusable(*entry)
                if why is not None:
                    self._idle.remove(entry)
                    self._discard(entry[0], why)
            if len(self._idle) >= self.size:
                self._need.clear()
                await self._wait_for_need()
                continue
            # shielded: a close() cancelling this loop must not cut a start half-way (close() closes
            # the sandbox once it is up); it stays in self._creating until it is in the pool
            self._creating = asyncio.ensure_future(self.runtime.create(self.warm_spec))
            try:
                sb = await asyncio.shield(self._creating)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - never raised into acquire(); it creates cold
                self._creating = None
                self.stats["failures"] += 1
                log.warning("warm pool: creating a sandbox failed (%s: %s); retrying in %.1fs",
                            type(e).__name__, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._backoff[1])
                continue
            self._creating = None
            self._idle.append((sb, time.monotonic()))
            delay = self._backoff[0]

    async def _wait_for_need(self) -> None:
        """Until an acquire took one, an idle sandbox died, or the oldest one is due for recycling."""
        waiters: list[asyncio.Future] = [asyncio.ensure_future(self._need.wait())]
        waiters += [sb.exited for sb, _ in self._idle]  # done when the sandbox's process exits
        timeout = None
        if self.max_idle is not None and self._idle:
            timeout = max(0.0, self._idle[0][1] + self.max_idle - time.monotonic()) + 0.01
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiters[0].cancel()

    async def _close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.wait([self._loop_task])
        closers = [self._close_quietly(sb) for sb, _ in self._idle]
        self._idle.clear()
        if self._creating is not None:
            closers.append(self._close_when_up(self._creating))
            self._creating = None
        if closers:
            await asyncio.gather(*closers)
        if self._closing:
            await asyncio.wait(list(self._closing))

    async def _close_when_up(self, creating: asyncio.Task) -> None:
        try:
            sb = await creating
        except Exception:  # noqa: BLE001 - the creation failed: nothing to close
            return
        await self._close_quietly(sb)
