"""The node's side of the job's policy: `PolicyGate`, the version LLM requests carry, held during weight updates, and
the fence of a keep or abort update over the `Stream`s in flight.

`heartbeat.Heartbeater` (and `policywatch`) set the gate from the controller's replies; each model call of
`llmgate.TrackedLLM` enters it, registers its `Stream` and `settle`s the stream's version runs as an update ends.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .prefillgate import PrefillGate
from .rategate import RateGate
from .tokengate import TokenGate

log = logging.getLogger("rolloutd.node")


class Stream:
    """One streamed generation in flight: the tokens received so far and, per keep-mode fence, where it stood.
    Abort mode (and keep mode on an engine that does not stamp its tokens): `abort` stops its current request on the
    engine; `parked` while it waits, aborted, for the update; `fenced` once a keep-mode fence aborted it."""

    def __init__(self, url: str | None) -> None:
        self.url = url
        self.abort: Callable[[], Awaitable[None]] | None = None
        self.parked = False
        self.fenced = False
        self.received = 0
        self.marks: list[int] = []  # token counts at fences whose new version is not known yet
        self.runs: list[tuple[Any, int]] = []  # (version, tokens) settled so far
        self.stamped: Callable[[], bool] = lambda: False  # the engine stamps its tokens: no quiet wait at a fence

    def got(self, n: int) -> None:
        self.received += n


class PolicyGate:
    """The node's view of the job's policy: the version new LLM requests are tagged with, whether new
    requests must wait (the weights are being updated), the backends that failed to load the current version
    (they still run an older one), and the fence of a keep or abort update (`fence_asked`/`fence_done`): the
    controller has paused the engines (keep: requests in place; abort: aborted) and asks where each in-flight
    stream stands."""

    def __init__(self, version: int | str | None = None) -> None:
        self.version = version
        self.mode = "drain"  # the job's spec.policy.updateMode
        self.inflight = 0
        self.drain_calls = 0  # drain-mode calls begun: every `llmgate.TIMED_EVERY`-th streams (`TrackedLLM.streams`)
        self.backend_versions: dict[str, Any] = {}
        self.fence_asked = 0
        self.fence_done = 0
        self.job_uid: str | None = None  # set when the controller labels every update (feature weight-stamps)
        self.streams: set[Stream] = set()
        self.on_change: Callable[[], None] = lambda: None  # tell the controller soon (a heartbeat)
        self._open = asyncio.Event()
        self._open.set()
        self._held = asyncio.Event()  # set while the gate holds (what `wait_paused` waits for, not a 20 ms poll)
        self._moved = asyncio.Event()  # a stream parked or ended: what the fence waits for
        self._fencing: asyncio.Task | None = None
        self.tokens = TokenGate()  # the job's share of each backend's tokens in flight (feature token-share)
        self.rates = RateGate()  # the job's share of each backend's processed tokens per second (feature work-share)
        self.prefill = PrefillGate()  # the node's long prompts awaiting their prefill: one per backend at a time

    def version_of(self, url: str | None) -> Any:
        """The version the backend at `url` runs (the job's, unless it failed to load that one)."""
        return self.backend_versions.get(url, self.version) if url else self.version

    def set(self, version: int | str | None, paused: bool, fence: int = 0,
            backend_versions: dict[str, Any] | None = None) -> None:
        self.version = version if version is not None else self.version
        if backend_versions is not None:
            self.backend_versions = dict(backend_versions)
        if fence > self.fence_asked:
            self.fence_asked = fence
            self._fencing = asyncio.get_running_loop().create_task(self._fence(fence))
        if paused and self._open.is_set():
            self._open.clear()
            self._held.set()
            self.on_change()  # report "held, N in flight" without waiting for the next beat
        elif not paused and not self._open.is_set():
            for s in self.streams:  # the update is over: tokens after each fence are the backend's new version
                for mark in s.marks:
                    settle(s, mark)
                    s.runs.append((self.version_of(s.url), 0))
                s.marks.clear()
            self._held.clear()
            self._open.set()

    async def _fence(self, epoch: int) -> None:
        """The engines are paused. abort mode: abort every stream's current request (the engine aborted those it ran;
        this also stops those that reached it after the pause, queued there). keep mode: a stream the engine stamps
        (`Stream.stamped`) stays in place, its split read from the stamps when it ends (its mark here is the fallback);
        a stream it does not stamp is aborted as in abort mode, since where its tokens stood at the pause cannot be
        proven from the outside (tokens arrive seconds after the engine made them on a loaded box). Then wait until
        every aborted stream is parked with its tokens so far (its split, exact) or ended."""
        started = time.monotonic()
        if self.mode == "abort":
            cut = [s for s in self.streams if s.abort is not None and not s.parked]
        else:
            cut = [s for s in self.streams if s.abort is not None and not s.parked and not s.stamped()]
            for s in self.streams:
                if s not in cut:
                    s.marks.append(s.received)
            for s in cut:
                s.fenced = True
        kept = len(self.streams) - len(cut)
        await asyncio.gather(*(s.abort() for s in cut), return_exceptions=True)
        deadline = time.monotonic() + 60  # bounded
        while time.monotonic() < deadline:
            self._moved.clear()
            if all(s.parked or s not in self.streams for s in cut):
                break
            with contextlib.suppress(TimeoutError):  # woken by each park or end (`moved`), checked twice a second
                await asyncio.wait_for(self._moved.wait(), 0.5)
        self.fence_done = max(self.fence_done, epoch)
        log.info("fence %d taken in %.3f s: %d stream(s) kept in place, %d cut and parked", epoch,
                 time.monotonic() - started, kept, len(cut))
        self.on_change()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    async def wait_open(self) -> None:
        await self._open.wait()

    async def wait_paused(self, timeout: float) -> None:
        """Until the gate is held, `timeout` seconds at most."""
        if not self.paused:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._held.wait(), timeout)

    def moved(self) -> None:
        """A stream parked or ended (the fence waits for the ones it aborted)."""
        self._moved.set()

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


def settle(s: Stream, upto: int) -> None:
    """Extend the stream's last run to `upto` tokens in all."""
    version, n = s.runs[-1]
    s.runs[-1] = (version, n + upto - sum(c for _, c in s.runs))
