"""Whole-episode admission per backend, shared among jobs by weighted fair queueing.

`backends.BackendPool.acquire` asks `Admission.admits` before it pins a task; `attempts` notes which nodes wait.

An episode is admitted when its task is pinned to a backend at lease time and keeps the admission
until its RUN ends (the pin's release: RUN left, result, cancel, give-back or lease expiry), so a
backend has no more episodes in RUN than its cap (but for what a full backend lends, below) and no agent waits
mid-episode in the engine's queue. The cap of a backend: the controller's `ROLLOUTD_MAX_EPISODES_PER_BACKEND`, else the `max_num_seqs` the
vLLM server reports (`/server_info`, learned by the health probe), else `FALLBACK_EPISODES`. A job's
`llm.maxEpisodesPerBackend` limits that job's episodes on each backend, never the backend: a tenant's small cap
cannot throttle another job sharing it.
Jobs sharing a backend share its cap by `spec.priority`: a job is admitted only if a slot is left once the
waiting jobs whose next admission would bring them less far, `(admitted + 1) / weight`, had theirs. A full backend
lends a job under its share the slots it is owed while another job holds more than its own (`owed`).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable

FALLBACK_EPISODES = 256  # vLLM's --max-num-seqs on most GPUs (128 on CPU): used when a backend does not say
WANT_SECONDS = 10.0  # a waiting node re-asks every lease long-poll (1.5 s): a mark older than this is a dead node's


@dataclass
class JobShare:
    urls: frozenset[str]
    cap: int | None  # llm.maxEpisodesPerBackend
    weight: int  # spec.priority


class Admission:
    def __init__(self, clock: Callable[[], float], default: int | None = None,
                 on_free: Callable[[Iterable[str]], None] = lambda jobs: None, tokens: int | None = None) -> None:
        self.clock, self.default = clock, default
        self.learning = False  # a health probe asks backends their max_num_seqs: an unasked one waits for it
        self.reported: dict[str, int | None] = {}  # url → max_num_seqs (None: the backend does not say)
        self.admitted: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # url → job → episodes
        self._jobs: dict[str, JobShare] = {}
        # url → job → (its nodes refused there, the latest refusal): what `waiting` reads on every admission
        self._wanting: dict[str, dict[str, tuple[set[str], float]]] = defaultdict(dict)
        self._marks: dict[str, tuple[str, tuple[str, ...]]] = {}  # node → (job, urls it waits on)
        self.on_free = on_free  # a slot these jobs wait for is free: wake their waiting leases
        # token share (`tokenshare`): the operator's budget of tokens in flight per backend (ROLLOUTD_BACKEND_TOKENS;
        # None: the engine's KV cache, `reported_tokens`), and each node's tokens in flight as its last beat said
        self.tokens = tokens
        self.reported_tokens: dict[str, int | None] = {}  # url → num_gpu_blocks × block_size (None: not said)
        self.node_tokens: dict[str, tuple[str, dict[str, int], float]] = {}  # node → (job, url → tokens, when)
        self.token_sums: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # url → job → their sum
        self.tokens_swept = 0.0  # when `tokenshare` last dropped the reports of nodes gone silent
        self.work = None  # the work share's measurements (`workshare.Work`, made at its first beat by `workshare.state`)
        self.replicas = 1  # node shards (`..shards`): the replicas that grant, each admitting its share of a cap

    # ---------------------------------------------------------------- jobs and caps

    def set_job(self, name: str, urls: Iterable[str], cap: int | None, weight: int) -> None:
        self._jobs[name] = JobShare(frozenset(urls), cap, max(weight, 1))

    def forget_job(self, name: str) -> None:
        self._jobs.pop(name, None)
        for wanting in self._wanting.values():
            wanting.pop(name, None)
        for node in [n for n, (job, _) in self._marks.items() if job == name]:
            del self._marks[node]
        for node in [n for n, (job, _, _) in self.node_tokens.items() if job == name]:
            del self.node_tokens[node]
        for sums in self.token_sums.values():
            sums.pop(name, None)

    def cap(self, url: str, job: str | None = None) -> int:
        """The episodes `url` admits at once for `job`: the backend's (`backend_cap`), or less when the job's own
        cap leaves it less."""
        backend = -(-self.backend_cap(url) // self.replicas)
        share = self._jobs.get(job) if job is not None else None
        return backend if share is None or share.cap is None else min(backend, -(-share.cap // self.replicas))

    def backend_cap(self, url: str) -> int:
        """The episodes `url` admits at once, over all jobs: the defaults only (no job sets it)."""
        if self.default is not None:
            return self.default
        if url in self.reported:
            return self.reported[url] or FALLBACK_EPISODES
        return 0 if self.learning else FALLBACK_EPISODES  # its probe comes within half a second

    def learned(self, url: str, max_num_seqs: int | None, tokens: int | None = None) -> None:
        """What the engine at `url` said of itself: its `max_num_seqs` and its KV cache in tokens (None: not said)."""
        self.reported[url] = max_num_seqs
        self.reported_tokens[url] = tokens

    def unlearn(self, url: str) -> None:
        """The backend went down: it may come back with another max_num_seqs (and KV cache)."""
        self.reported.pop(url, None)
        self.reported_tokens.pop(url, None)

    def urls_of(self, job: str) -> frozenset[str]:
        """The backends `job` may use (its `set_job` list)."""
        share = self._jobs.get(job)
        return share.urls if share is not None else frozenset()

    # ---------------------------------------------------------------- admitting

    def weight(self, job: str) -> int:
        share = self._jobs.get(job)
        return share.weight if share is not None else 1

    def _tag(self, url: str, job: str) -> float:
        return (self.admitted[url][job] + 1) / self.weight(job)

    def waiting(self, url: str) -> list[str]:
        """Jobs with a node that was refused on `url` and asked again within WANT_SECONDS (a job whose
        waiting nodes all went silent stops holding slots)."""
        wanting = self._wanting.get(url)
        if not wanting:
            return []
        old = self.clock() - WANT_SECONDS
        return [job for job, (nodes, last) in wanting.items() if nodes and last >= old]

    def admits(self, url: str, job: str | None, inflight: int) -> bool:
        """Whether `job` may start one more episode on `url`, which has `inflight` episodes."""
        free = self.backend_cap(url) - inflight
        if job is not None and self.admitted[url][job] >= self.cap(url, job):
            return False  # the job's own cap
        if job is None:
            return free > 0
        if free <= 0:
            return self.owed(url, job)
        others = [k for k in self.waiting(url) if k != job]
        if not others:
            return True
        # the free slots, given one by one to the smallest tag, go to waiting jobs ahead of `job` as long as
        # their tag stays below its: a job of weight w with a admitted takes ⌈mine·w − a − 1⌉ of them first
        mine = self._tag(url, job)
        ahead = sum(max(0, math.ceil(mine * self.weight(k) - self.admitted[url][k] - 1 - 1e-9)) for k in others)
        return free > ahead

    def owed(self, url: str, job: str) -> bool:
        """Whether the full backend `url` lends `job` one more episode beyond its cap: `job` stays within its
        weighted share of the cap (among the jobs with episodes there or waiting) and another job holds more than
        its own. Episodes keep their slot for their whole RUN, so without it a job that came first would keep a
        latecomer out until its episodes end (hours, at a policy's stage timeout); lent, the backend holds the cap
        plus the over-share jobs' excess, the token share (`tokenshare`) brings the over-share job's calls down to
        its part, and the excess is not replaced as its episodes leave RUN."""
        admitted = self.admitted[url]
        present = {k for k, n in admitted.items() if n > 0} | set(self.waiting(url)) | {job}
        weights = sum(self.weight(k) for k in present)
        whole = self.backend_cap(url)
        if (admitted[job] + 1) * weights > whole * self.weight(job):
            return False  # one more would take it past its own share
        return any(admitted[k] * weights > whole * self.weight(k) for k in present if k != job)

    def take(self, url: str, job: str | None) -> None:
        if job is not None:
            self.admitted[url][job] += 1

    def give(self, url: str, job: str | None) -> None:
        if job is not None and self.admitted[url][job] > 0:
            self.admitted[url][job] -= 1
        self._wake(url)

    def _wake(self, url: str) -> None:
        jobs = self.waiting(url)
        if jobs:
            self.on_free(jobs)

    # ---------------------------------------------------------------- who waits

    def note(self, node: str, job: str, refused: Iterable[str]) -> None:
        """A lease of `node` (of `job`) was cut short by admission on the backends `refused` (none: it got
        what it asked for, or the queue is empty). A node that stops waiting frees what it was owed."""
        urls = tuple(refused)
        old = self._marks.pop(node, None)
        if old is not None:
            old_job, old_urls = old
            for url in old_urls:
                entry = self._wanting.get(url, {}).get(old_job)
                if entry is not None:
                    entry[0].discard(node)
                    if not entry[0]:
                        del self._wanting[url][old_job]
        if urls:
            now = self.clock()
            for url in urls:
                nodes = self._wanting[url].get(job, (set(), now))[0]
                nodes.add(node)
                self._wanting[url][job] = (nodes, now)
            self._marks[node] = (job, urls)
        if old is not None:
            for url in set(old[1]) - set(urls):
                self._wake(url)
