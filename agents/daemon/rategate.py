"""The node's share of a shared engine's work per second (node-protocol feature work-share): `RateGate` holds a model
call, before it is sent, while the job is over its processed tokens per second on that backend (`controller.work.workshare`).

`llmgate.TrackedLLM` passes every call through `RateGate.slot`; `heartbeat.Heartbeater` reports the tokens the node's
calls processed (`processed`, cumulative per backend) and its holds (`held_calls`, `held_seconds`) on each beat, and
sets the allowances from the reply (`set`: tokens per second per episode, × the node's episodes in RUN there). The rule
is a token bucket per backend, filled at the allowance, at most `BURST_SECONDS` of it: a call may start while the
bucket is not below zero; it takes its prompt's tokens when it starts and, once it ends, its generated tokens (and
gives back the prompt tokens the engine had cached). So one 65 536-token prefill leaves the job waiting about as long
as its allowance takes to process that many tokens. Debt is bounded: at most `MAX_HOLD_SECONDS` of the allowance (the
controller's window: debt older than what it measures is forgiven, so an allowance measured low never starves a job),
but never less than the call just charged (a prompt worth more than the window is paid whole: forgiving part of
it let a job of whole-context prompts keep most of the engine, bench/results/RESULTS-fairshare.md). A bucket made
when a limit first comes takes the prompts of the calls already in flight (they started unlimited: the engine is
processing them for this job now). A call is never failed or split here, only delayed; a held call is cancelled like
any other await. An allowance of 0, or none: no limit.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from typing import AsyncIterator, Callable

from rolloutd.crds.node import WORK_WINDOW_SECONDS

BURST_SECONDS = 2.0  # a bucket holds this many seconds of its allowance (calls between two beats' replies)
MAX_HOLD_SECONDS = WORK_WINDOW_SECONDS  # a bucket's debt is at most this many seconds of its allowance


class Charge:
    """One call's charge: its prompt at the start; `done` adds what the engine answered."""

    def __init__(self, prompt: int) -> None:
        self.prompt = prompt
        self.generated = self.cached = 0
        self.paid = False  # its prompt was charged to a bucket (at its start, or when its backend's bucket was made)

    def done(self, generated: int, cached: int | None) -> None:
        self.generated, self.cached = generated, min(cached or 0, self.prompt)


class RateGate:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.per_episode: dict[str, float] = {}  # url → the job's tokens/s per admitted episode (0 or absent: none)
        self.episodes: Callable[[str], int] = lambda url: 1  # the node's episodes in RUN on url (set by the daemon)
        self.level: dict[str, float] = {}  # url → the bucket's tokens (negative: debt)
        self.at: dict[str, float] = {}  # url → when the bucket was last filled
        self.processed: dict[str, int] = defaultdict(int)  # url → tokens the node's calls processed, ever
        self.waiting = 0  # calls held now
        self.wanted: dict[str, int] = defaultdict(int)  # url → prompt tokens of the calls held now (the job's demand)
        self.held_calls = 0  # calls that were held, ever
        self.held_seconds = 0.0  # seconds calls were held, ever
        self.served = False  # the controller shares work (work-share served at registration)
        self.unpaid: dict[str, set[Charge]] = defaultdict(set)  # url → calls in flight that started without a limit
        self._changed = asyncio.Event()

    def rate(self, url: str | None) -> float | None:
        """The node's tokens per second allowed on `url` (None: no limit)."""
        per = self.per_episode.get(url) if url else None
        return None if not per else per * max(1, self.episodes(url))

    def set(self, per_episode: dict[str, float] | None, served: bool = True) -> None:
        """The controller's allowances (a beat's reply `llmRates`): 0 or absent lifts a backend's limit."""
        self.served = served
        new = {u: r for u, r in (per_episode or {}).items() if r}
        if new != self.per_episode:
            for url in list(self.level):
                self._fill(url)  # at the old rate up to now
            self.per_episode = new
            for url in [u for u in self.level if u not in new]:
                del self.level[url], self.at[url]  # no limit: no debt kept
            for url in [u for u in self.unpaid if u in new]:
                self._fill(url)  # a new limit: the calls in flight pay now (a 1-token call may end before the next)
            self.wake()

    def wake(self) -> None:
        """Every held call looks at its bucket again (a new allowance; a test's clock moved)."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def report(self) -> tuple[dict[str, int], list[float]]:
        """A beat's `llmProcessed` and `llmRateHeld` ([calls held, seconds held], both ever)."""
        return dict(self.processed), [float(self.held_calls), round(self.held_seconds, 3)]

    def _fill(self, url: str) -> float | None:
        """The bucket of `url` filled up to now; its rate (None: no limit)."""
        rate = self.rate(url)
        now = self.clock()
        if rate is None:
            return None
        if url not in self.level:  # a new limit: the calls it finds in flight pay their prompts now
            self.level[url], self.at[url] = rate * BURST_SECONDS - sum(c.prompt for c in self.unpaid[url]), now
            for c in self.unpaid.pop(url, ()):
                c.paid = True
        self.level[url] = min(rate * BURST_SECONDS, self.level[url] + (now - self.at[url]) * rate)
        self.at[url] = now
        return rate

    def wait(self, url: str) -> float | None:
        """None: a call may go now; else the seconds until the bucket is back to zero."""
        rate = self._fill(url)
        if rate is None or self.level[url] >= 0:
            return None
        return -self.level[url] / rate

    def charge(self, url: str, tokens: float, whole: float | None = None) -> None:
        """`tokens` more of a call whose charge comes to `whole` (default: `tokens`): debt grows to at most the
        larger of `MAX_HOLD_SECONDS` of the allowance and `whole`; a charge never forgives debt already there."""
        rate = self._fill(url)
        if rate is not None:
            level = self.level[url]
            floor = -max(rate * MAX_HOLD_SECONDS, tokens if whole is None else whole)
            new = level - tokens
            self.level[url] = new if new >= floor or tokens <= 0 else min(level, floor)

    @contextlib.asynccontextmanager
    async def slot(self, url: str | None, prompt: int) -> AsyncIterator[Charge | None]:
        """Hold until `url`'s bucket is not in debt, then charge the prompt; the caller reports the answer on the
        yielded `Charge` (`done`), charged when the call ends, however it ends."""
        if url is None:
            yield None
            return
        if (wait := self.wait(url)) is not None:
            self.waiting += 1
            self.held_calls += 1
            self.wanted[url] += prompt
            started = self.clock()
            try:
                while wait is not None:
                    changed = self._changed
                    with contextlib.suppress(TimeoutError):  # a new allowance wakes it first
                        await asyncio.wait_for(changed.wait(), timeout=min(wait, 5.0))
                    wait = self.wait(url)
            finally:
                self.waiting -= 1
                self.wanted[url] -= prompt
                self.held_seconds += self.clock() - started
        c = Charge(prompt)
        if self.rate(url) is None:
            self.unpaid[url].add(c)
        else:
            self.charge(url, prompt)  # fills the bucket (making it if the limit is new) and charges
            c.paid = True
        try:
            yield c
        finally:
            if url in self.unpaid:
                self.unpaid[url].discard(c)
            if c.paid:
                self.charge(url, c.generated - c.cached, c.prompt - c.cached + c.generated)
            self.processed[url] += c.prompt - c.cached + c.generated
