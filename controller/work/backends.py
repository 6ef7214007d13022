"""The LLM backend pool: a min-heap keyed by in-flight tasks, with health.

Used by the scheduler at lease time (`acquire`: pin the least-loaded healthy backend to a task)
and when a task leaves RUN (`release`). Unlike the seed system's heap, the key is the number of
tasks *currently* pinned (not cumulative assignments), unhealthy backends are skipped, and
backends can be added and removed while jobs run. Counts are global per URL: two jobs sharing a
vLLM server see each other's load.
"""
from __future__ import annotations

import heapq
import itertools
from collections import defaultdict
from typing import Iterable


class BackendPool:
    def __init__(self) -> None:
        self.inflight: dict[str, int] = defaultdict(int)
        self.unhealthy: dict[str, str] = {}  # url → reason
        self._heap: list[tuple[int, int, str]] = []
        self._seq = itertools.count()
        self._known: set[str] = set()

    def add(self, url: str) -> None:
        if url not in self._known:
            self._known.add(url)
            self._push(url)

    def discard(self, url: str) -> None:
        """Forget a backend that no job lists any more (its in-flight count stays until released)."""
        self._known.discard(url)

    def known(self) -> set[str]:
        return set(self._known)

    def healthy(self, url: str) -> bool:
        return url in self._known and url not in self.unhealthy

    def set_health(self, url: str, ok: bool, reason: str = "") -> bool:
        """Returns True when the state changed."""
        was = url not in self.unhealthy
        if ok:
            self.unhealthy.pop(url, None)
            if not was:
                self._push(url)
        else:
            self.unhealthy[url] = reason or "unhealthy"
        return was != ok

    def _push(self, url: str) -> None:
        heapq.heappush(self._heap, (self.inflight[url], next(self._seq), url))

    def acquire(self, allowed: Iterable[str]) -> str | None:
        """Pin the least-loaded healthy backend among `allowed`; None if there is none."""
        allowed = set(allowed)
        aside: list[tuple[int, int, str]] = []
        chosen = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            count, _, url = entry
            if url not in self._known or url in self.unhealthy or count != self.inflight[url]:
                continue  # stale entry: a fresher one exists or the backend is out
            if url in allowed:
                chosen = url
                break
            aside.append(entry)
        for entry in aside:
            heapq.heappush(self._heap, entry)
        if chosen is None:
            # `allowed` may hold backends never added (e.g. just listed by a job): add and retry once
            fresh = [u for u in allowed if u not in self._known]
            for u in fresh:
                self.add(u)
            if fresh:
                return self.acquire(allowed)  # terminates: nothing is fresh the second time
            return None
        self.inflight[chosen] += 1
        self._push(chosen)
        return chosen

    def take(self, url: str) -> None:
        """Count a pin restored from the database (controller restart)."""
        self.inflight[url] += 1
        if url in self._known:
            self._push(url)

    def release(self, url: str | None) -> None:
        if not url:
            return
        if self.inflight[url] > 0:
            self.inflight[url] -= 1
        if url in self._known and url not in self.unhealthy:
            self._push(url)
