"""The node's share of a shared engine's work (node-protocol feature token-share): `TokenGate` holds a model call
until it fits the job's token allowance on its backend, which the controller hands each beat (`controller.work.tokenshare`).

`llmgate.TrackedLLM` passes every call through `TokenGate.slot` before the policy gate; `heartbeat.Heartbeater`
reports the node's tokens in flight on each beat (`TokenGate.report`) and sets the allowances from the reply
(`TokenGate.set`). A call costs its prompt's tokens plus its sampling `max_tokens` (what the node knows before
sending it); a beat reports the tokens in flight and those of the calls held here. The controller's allowance
already lends what other jobs leave unused (it is the job's part only while the backend is full: its demands,
held calls included, reach its budget), so the node's rule is local, per backend: its tokens in flight stay within its
episodes' part of the allowance, averaged over time. A call that fits what is left goes at once; a call larger
than the whole allowance goes alone (never split, never refused) when nothing else of the node is in flight there,
and then holds the backend's gate for `seconds × (cost / allowance − 1)` after it ends, so that its tokens ×
seconds average back down to the allowance. An allowance of 0, or none: no cap (the job is alone on the backend,
or the controller does not share tokens). The reply names every backend the job may use, so a call waits for a
reply only when its backend is one no reply named yet (a beat asked at once, 3 s at most, once per backend).
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from typing import AsyncIterator, Callable

FRESH_SECONDS = 3.0  # bounded wait for a beat's reply naming a backend the node had not heard of
MAX_HOLD_SECONDS = 600.0  # bounded: an allowance cut to almost nothing mid-call holds the next call at most this


class TokenGate:
    def __init__(self) -> None:
        self.per_episode: dict[str, int] = {}  # url → the job's tokens per admitted episode there (0 or absent: no cap)
        self.episodes: Callable[[str], int] = lambda url: 1  # the node's episodes in RUN on url (set by the daemon)
        self.in_flight: dict[str, int] = defaultdict(int)  # url → tokens of this node's calls in flight
        self.calls: dict[str, int] = defaultdict(int)  # url → calls in flight
        self.hold_until: dict[str, float] = {}  # url → monotonic time before which no new call starts
        self.waiting = 0  # calls held at this gate now
        self.wanted: dict[str, int] = defaultdict(int)  # url → tokens of the calls held here now
        self.held = 0  # calls that were held, ever (a counter for tests and the node's stats)
        self.served = False  # the controller shares tokens (token-share served at registration)
        self.known: set[str] = set()  # backends a reply named, or a call already waited for once
        self.ask: Callable[[], None] = lambda: None  # beat now (set by the heartbeat)
        self._changed = asyncio.Event()  # replaced at each change: set wakes every call waiting on it

    def allowance(self, url: str | None) -> int | None:
        """The node's tokens in flight allowed on `url`: the job's per-episode allowance × its episodes here."""
        per = self.per_episode.get(url) if url else None
        return None if not per else per * max(1, self.episodes(url))

    def report(self, held: dict[str, int] | None = None) -> dict[str, int]:
        """url → the tokens this node has in flight or held there now (its demand: a beat's `llmTokens`); `held`: the
        calls the work share holds before they reach this gate (`rategate.RateGate.wanted`)."""
        held = held or {}
        urls = set(self.in_flight) | set(self.wanted) | set(held)
        return {url: n for url in urls
                if (n := self.in_flight.get(url, 0) + self.wanted.get(url, 0) + held.get(url, 0)) > 0}

    def set(self, per_episode: dict[str, int] | None, served: bool = True) -> None:
        """The controller's allowances (a beat's reply `llmTokens`): 0 or absent lifts a backend's cap."""
        new = dict(per_episode or {})
        self.served = served
        self.known |= set(new)
        if new != self.per_episode:
            self.per_episode = new
            for url in [u for u in self.hold_until if not new.get(u)]:
                del self.hold_until[url]
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _fits(self, url: str, cost: int) -> float | None:
        """None: the call may go now; else seconds to wait at most before looking again."""
        limit = self.allowance(url)
        if limit is None:
            return None
        hold = self.hold_until.get(url, 0.0) - time.monotonic()
        if hold > 0:
            return hold
        if self.calls[url] == 0 or self.in_flight[url] + cost <= limit:
            return None
        return 5.0  # a release or a new allowance wakes it first

    async def fresh(self, url: str | None) -> None:
        """The first call to a backend no reply named yet waits for one (its share, and the work share's, unknown)."""
        if url is not None and self.served and url not in self.known:
            self.ask()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=FRESH_SECONDS)
            self.known.add(url)  # once per backend, whatever the reply said

    @contextlib.asynccontextmanager
    async def slot(self, url: str | None, cost: int) -> AsyncIterator[None]:
        """Hold until a call of `cost` tokens to `url` fits the node's allowance, then count it in flight."""
        if url is None:
            yield
            return
        await self.fresh(url)
        wait = self._fits(url, cost)
        if wait is not None:
            self.waiting += 1
            self.held += 1
            self.wanted[url] += cost  # reported: a backend where jobs wait is full
            try:
                while (wait := self._fits(url, cost)) is not None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), timeout=min(wait, 5.0))
            finally:
                self.waiting -= 1
                self.wanted[url] -= cost
        self.in_flight[url] += cost
        self.calls[url] += 1
        started = time.monotonic()
        try:
            yield
        finally:
            self.in_flight[url] -= cost
            self.calls[url] -= 1
            limit = self.allowance(url)
            if limit is not None and cost > limit:
                now = time.monotonic()
                hold = min((now - started) * (cost / limit - 1), MAX_HOLD_SECONDS)
                self.hold_until[url] = max(self.hold_until.get(url, 0.0), now + hold)
            self._wake()
