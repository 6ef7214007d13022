"""The LLM backends' pool: the min-heap of in-flight tasks per backend URL, and which backends are healthy.

`queue` pins a backend at lease time (`BackendPool.acquire`, within `admission`'s caps) and releases it when a
task leaves RUN; `backend_health.HealthProbe` marks backends up or down (`set_health`); the trainer API and the
web UI show `view`. vLLM's admin calls are `backend_http.py`'s.
Unlike the seed system's heap, the key is the number of tasks *currently* pinned (not cumulative
assignments), unhealthy backends are skipped, and backends can be added and removed while jobs
run. Counts are global per URL: two jobs sharing a vLLM server see each other's load.
"""
from __future__ import annotations

import heapq
import itertools
import time
from collections import defaultdict
from typing import Callable, Iterable

from .admission import Admission


class BackendPool:
    def __init__(self, admission: Admission | None = None) -> None:
        self.admission = admission if admission is not None else Admission(time.time)
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

    def outage(self, url: str | None, urls: list[str]) -> bool:
        """Backend `url` is down and so is every other of `urls` (a job's): a failure on it is the outage's, and
        its rollout waits in the queue (leasing pauses) until a backend is healthy again."""
        return bool(url) and not self.healthy(url) and not any(self.healthy(u) for u in urls)

    def set_health(self, url: str, ok: bool, reason: str = "") -> bool:
        """Returns True when the state changed."""
        was = url not in self.unhealthy
        if ok:
            self.unhealthy.pop(url, None)
            if not was:
                self._push(url)
        else:
            self.unhealthy[url] = reason or "unhealthy"
            self.admission.unlearn(url)  # it may come back with another max_num_seqs
        return was != ok

    def _push(self, url: str) -> None:
        heapq.heappush(self._heap, (self.inflight[url], next(self._seq), url))

    def acquire(self, allowed: Iterable[str], job: str | None = None) -> str | None:
        """Pin the least-loaded healthy backend among `allowed` that admits one more episode of `job`;
        None if there is none."""
        allowed = set(allowed)
        aside: list[tuple[int, int, str]] = []
        chosen = None
        while self._heap:
            entry = heapq.heappop(self._heap)
            count, _, url = entry
            if url not in self._known or url in self.unhealthy or count != self.inflight[url]:
                continue  # stale entry: a fresher one exists or the backend is out
            if url in allowed and self.admission.admits(url, job, count):
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
                return self.acquire(allowed, job)  # terminates: nothing is fresh the second time
            return None
        self.inflight[chosen] += 1
        self.admission.take(chosen, job)
        self._push(chosen)
        return chosen

    def take(self, url: str, job: str | None = None) -> None:
        """Count a pin restored from the database (controller restart)."""
        self.inflight[url] += 1
        self.admission.take(url, job)
        if url in self._known:
            self._push(url)

    def release(self, url: str | None, job: str | None = None) -> None:
        if not url:
            return
        if self.inflight[url] > 0:
            self.inflight[url] -= 1
        if url in self._known and url not in self.unhealthy:
            self._push(url)
        self.admission.give(url, job)

    def pinned(self, job: str) -> dict[str, int]:
        """Backend URL → the job's tasks pinned to it now, from admission's counts in memory, not a GROUP BY over the
        job's items (a dashboard asks every second; docs/content/benchmarks.md, "Constants")."""
        return {url: n for url, jobs in list(self.admission.admitted.items()) if (n := jobs.get(job, 0)) > 0}

    def view(self, job: str, urls: Iterable[str], shown: Callable[[str], bool] = lambda url: True) -> list[dict]:
        """The job's backends as the trainer API and the web UI show them; `shown(url)` False: a caller who may see
        only that the backend is up or down (its reason reads "down")."""
        pinned, out = self.pinned(job), []
        for url in urls:
            url = url.rstrip("/")
            reason = self.unhealthy.get(url, "")
            out.append({"url": url, "healthy": url not in self.unhealthy,
                        "reason": "down" if reason and not shown(url) else reason,
                        "inflight": self.inflight.get(url, 0), "pinnedToJob": pinned.get(url, 0),
                        "admissionCap": self.admission.cap(url, job)})
        return out
