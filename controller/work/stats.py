"""A job's trajectories summed up, in SQL and on the server: never the whole table to a browser or a CLI.

Called by the web UI (`ui/app.py`, `ui/live.py`: job page, jobs list) and the API's `GET …/stats`
(`http/trainer.py`, what `rolloutctl describe` prints), which share one `JobStats`. Counts by failure kind, the
reward mean, per-stage p50/p95, rewards per policy version and failures by reason come from `JobStats`, which reads
each trajectory once (the rows after the last seq it saw) and keeps the running sums in memory. It reads the
columns the feed copies out of each document, from the covering index `ix_trajectories_facts` (`work/tables.py`),
never `data` (seconds at 100 000 rollouts).
Throughput over time: rollouts finished per time bucket, from each trajectory's end (`t_end`), kept per second
(coarser as a long job's seconds grow past ENDS_KEPT) and drawn in at most THROUGHPUT_BUCKETS buckets.
One trajectory and its group are read back by `trajectory_reads.py`, a page of them by `ui/jobview.py`.
Next step: throughput per node (the trajectory's node is not a column yet).
"""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from sqlalchemy.engine import Engine

from ..dialects import raw
from .stage_times import Times, histogram, percentile

STAGES = ("queue", "init", "run", "eval")
REWARD_BINS = 10
EXAMPLES = 3
THROUGHPUT_BUCKETS = 60
ENDS_KEPT = 4096  # distinct end times kept per job; beyond, the resolution halves (memory stays bounded)
CHUNK = 500  # rows summed per slice of the event loop (~1 ms): a first read, from the covering index
# rows per slice of the loop where each row is a lookup in the table's pages, which the nodes' commits leave cold:
# failed rows' reasons by seq, and a later read's rows (measured: the benchmarks page, "Constants")
REASONS_CHUNK = 100
LATER_CHUNK = 50
FAILED = ("agent", "infra", "config")  # the failure kinds whose reasons are counted


@dataclass
class _Acc:
    uid: str
    last_seq: int = 0
    stages: dict[str, Times] = field(default_factory=lambda: {s: Times() for s in STAGES})
    rewards: list[int] = field(default_factory=lambda: [0] * REWARD_BINS)
    reward_lo: float = 0.0
    reward_hi: float = 1.0
    out_of_range: int = 0
    by_policy: dict[str, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0.0, 0]))
    reasons: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    examples: dict[tuple[str, str], list[int]] = field(default_factory=lambda: defaultdict(list))
    ends: Counter = field(default_factory=Counter)  # int(t_end // resolution) → rollouts
    resolution: int = 1  # seconds per key of `ends`
    unplaced: int = 0  # rollouts without an end time (from before the column, their documents had no stamp)
    kinds: Counter = field(default_factory=Counter)  # failure kind → trajectories (every row, once)
    scored: list[float] = field(default_factory=lambda: [0.0, 0])  # reward sum and count, infra left out


@dataclass
class _Final:
    """A finished job's numbers, rendered once from its sums (which are then dropped): a few kB, not its stage times."""
    uid: str
    last_seq: int
    out: dict[str, Any]


class JobStats:
    """Running aggregates per job (keyed with the job's uid: a job created again under its name starts afresh).

    On the event loop (the UI, the API's `…/stats`): `numbers`, which reads the rows since the last view CHUNK rows at
    a time and yields to the loop between chunks, in a task of its own (a caller that goes away does not leave the
    sums half-applied; the callers of one moment share it). Without a loop (tools, tests): `summary`, `counts`.
    Never from two threads at once. A finished job's sums give way to its rendered numbers (`_Final`), read again
    only if a trajectory arrives after all; a deleted job's go (`forget`, from `core.Work.drop`)."""

    def __init__(self, engine: Engine, observe_step: Callable[[float], None] | None = None):
        """`observe_step`: each slice's CPU on the loop (`numbers`), in seconds (the web UI's step metric)."""
        self.engine = engine
        self._acc: dict[str, _Acc] = {}
        self._final: dict[str, _Final] = {}
        self._tasks: dict[str, asyncio.Future] = {}
        self.observe_step = observe_step or (lambda seconds: None)

    # ------------------------------------------------------------ without a loop (tools, tests)

    def summary(self, job: str, uid: str) -> dict[str, Any]:
        acc = self._caught_up(job, uid)
        for xs in acc.stages.values():
            xs.settle()
        return self._render(acc)

    def counts(self, job: str, uid: str) -> dict[str, Any]:
        """Trajectories by failure kind, the infra rate and the reward mean (infra left out), from the running sums
        (a restarted controller sums the store once again; `tests/ui/test_job_numbers.py` recounts them)."""
        return _counts(self._caught_up(job, uid))

    def _caught_up(self, job: str, uid: str) -> _Acc:
        acc = self._acc_of(job, uid)
        for _ in self._steps(job, acc):
            pass
        return acc

    # ------------------------------------------------------------ on the event loop

    async def numbers(self, job: str, uid: str, *, finished: bool = False, summary: bool = True) -> dict[str, Any]:
        """{"counts": `counts`, "summary": `summary` or None (not asked)}; `finished`: the job reached a final
        phase, its sums may give way to the numbers rendered now."""
        while True:
            task = self._tasks.get(job)
            if task is None:
                task = self._tasks[job] = asyncio.ensure_future(self._build(job, uid, finished, summary))
                task.add_done_callback(lambda t, job=job: self._tasks.pop(job) if self._tasks.get(job) is t else None)
                return await asyncio.shield(task)
            out = await asyncio.shield(task)  # one made for another caller this moment: shared if it will do
            if out["uid"] == uid and (out["summary"] is not None or not summary):
                return out

    async def _build(self, job: str, uid: str, finished: bool, summary: bool) -> dict[str, Any]:
        final = self._final.get(job)
        if final is not None and final.uid == uid:
            with self.engine.connect() as c:
                if _max_seq(raw(c), job) == final.last_seq:
                    return final.out
            del self._final[job]  # a trajectory after all: summed again from the store
        acc = self._acc_of(job, uid)
        t = time.thread_time()
        try:
            for _ in self._steps(job, acc):
                self.observe_step(time.thread_time() - t)
                await asyncio.sleep(0)  # the loop serves the nodes' calls between chunks
                t = time.thread_time()
            out = {"uid": uid, "counts": _counts(acc), "summary": None}
            if summary or finished:
                for xs in acc.stages.values():
                    xs.settle()  # the new times sorted (and now and then merged), one stage per slice
                    self.observe_step(time.thread_time() - t)
                    await asyncio.sleep(0)
                    t = time.thread_time()
                out["summary"] = self._render(acc)
            self.observe_step(time.thread_time() - t)
        except BaseException:
            self._acc.pop(job, None)  # half-applied: the next view sums the store again
            raise
        if finished:
            self._final[job] = _Final(uid, acc.last_seq, out)
            self._acc.pop(job, None)
        return out

    def forget(self, job: str) -> None:
        """The job was deleted: nothing of its sums stays."""
        self._acc.pop(job, None)
        self._final.pop(job, None)

    def kept(self) -> dict[str, int]:
        """What the sums hold in memory: jobs with running sums, finished jobs' rendered numbers, stage times."""
        return {"running": len(self._acc), "final": len(self._final),
                "stage_times": sum(len(xs) for acc in list(self._acc.values()) for xs in acc.stages.values())}

    # ------------------------------------------------------------ the sums

    def _acc_of(self, job: str, uid: str) -> _Acc:
        acc = self._acc.get(job)
        if acc is None or acc.uid != uid:
            acc = self._acc[job] = _Acc(uid)
            self._final.pop(job, None)
        return acc

    def _steps(self, job: str, acc: _Acc, size: int = CHUNK) -> Iterator[None]:
        """Catch `acc` up with the job's rows after the last seq it saw, `size` rows per step (a generator: the
        caller may pause between steps). The columns the feed copied out of each document: a first read walks the
        covering index (its order is not seq's, which the sums do not need), a later one only the rows after the
        last seq seen; both reads stop at the same seq (a row stored between them waits for the next view).
        A later read is one short statement per step (the next `size` rows by seq), never a statement left open
        across a pause: an open statement pins the WAL at its snapshot, and at a thousand nodes the WAL then grew
        until the node calls' own commits checkpointed it inline (stalls of 100-300 ms in `bench ui_toggle`).
        The first read (once per job and controller) still walks the index in one statement."""
        with self.engine.connect() as c:
            db = raw(c)
            max_seq = _max_seq(db, job)
            if max_seq <= acc.last_seq:
                return
            columns = "SELECT seq, reward, failure, t_queue, t_init, t_run, t_eval, policy, t_end FROM trajectories "
            failed: list[int] = []
            if acc.last_seq == 0:
                rows = db.execute(columns + "INDEXED BY ix_trajectories_facts WHERE job = ? AND seq <= ?", (job, max_seq))
                while chunk := rows.fetchmany(size):
                    failed += _add_rows(acc, chunk)
                    yield
            else:
                after = acc.last_seq
                while chunk := db.execute(columns + "WHERE job = ? AND seq > ? AND seq <= ? ORDER BY seq LIMIT ?",
                                          (job, after, max_seq, min(size, LATER_CHUNK))).fetchall():
                    failed += _add_rows(acc, chunk)
                    after = chunk[-1][0]
                    yield
            # the failure reasons are not in the index (text made each insert dearer): read from the failed rows, by
            # seq (a scan of the job's failed rows for the few new ones made one step grow with the job)
            failed.sort()
            for i in range(0, len(failed), REASONS_CHUNK):
                part = failed[i:i + REASONS_CHUNK]
                for seq, failure, reason in db.execute("SELECT seq, failure, reason FROM trajectories WHERE seq IN "
                                                       f"({','.join('?' * len(part))})", part):
                    why = (reason or "").strip()[:200]
                    acc.reasons[failure][why] += 1
                    acc.examples[(failure, why)].append(seq)
                yield
        acc.last_seq = max_seq
        while len(acc.ends) > ENDS_KEPT:  # halve the resolution: floor(t / 2r) == floor(floor(t / r) / 2)
            coarser: Counter = Counter()
            for k, n in acc.ends.items():
                coarser[k // 2] += n
            acc.ends, acc.resolution = coarser, acc.resolution * 2
        for key, seqs in acc.examples.items():  # the first few of each reason
            if len(seqs) > EXAMPLES:
                acc.examples[key] = sorted(seqs)[:EXAMPLES]

    @staticmethod
    def _render(acc: _Acc) -> dict[str, Any]:
        """The summary of sums whose stage times are settled."""
        width = (acc.reward_hi - acc.reward_lo) / REWARD_BINS
        return {
            "stages": [{"stage": s, "n": len(xs), "p50": percentile(xs, 0.5), "p95": percentile(xs, 0.95),
                        "seconds": round(xs.total, 3), "histogram": histogram(xs)} for s, xs in acc.stages.items()],
            "rewardHistogram": [{"lo": round(acc.reward_lo + i * width, 4), "hi": round(acc.reward_lo + (i + 1) * width, 4),
                                 "n": n} for i, n in enumerate(acc.rewards)],
            "rewardOutOfRange": acc.out_of_range,
            "rewardByPolicy": [{"policyVersion": json.loads(v), "n": n, "mean": round(s / n, 4)}
                               for v, (s, n) in sorted(acc.by_policy.items())],
            "failures": [{"kind": kind, "count": sum(c.values()),
                          "reasons": [{"reason": r, "count": n, "examples": acc.examples[(kind, r)]}
                                      for r, n in c.most_common(5)]}
                         for kind, c in sorted(acc.reasons.items())],
            "throughput": _throughput(acc),
        }


def _max_seq(db, job: str) -> int:
    return db.execute("SELECT max(seq) FROM trajectories WHERE job = ?", (job,)).fetchone()[0] or 0


def _counts(acc: _Acc) -> dict[str, Any]:
    total, (s, n) = sum(acc.kinds.values()), acc.scored
    return {"delivered": total, "byKind": dict(acc.kinds),
            "infraRate": round(acc.kinds.get("infra", 0) / total, 4) if total else None,
            "rewardMean": round(s / n, 4) if n else None}


def _add_rows(acc: _Acc, rows: list[tuple]) -> list[int]:
    """`rows` added to the sums; the seqs of the failed ones (their reasons are read apart)."""
    stages = [acc.stages[s] for s in STAGES]
    kinds, scored, failed = acc.kinds, acc.scored, []
    for seq, reward, failure, tq, ti, tr, te, version, end in rows:
        kinds[failure] += 1
        if failure in FAILED:
            failed.append(seq)
        if reward is not None and failure != "infra":
            scored[0] += reward
            scored[1] += 1
        if end is None:
            acc.unplaced += 1
        else:
            acc.ends[int(end // acc.resolution)] += 1
        if failure == "none" or failure == "agent":  # infra and config failures did not run to the end
            for xs, t in zip(stages, (tq, ti, tr, te)):
                if t is not None:
                    xs.append(t)
        if reward is not None:
            if acc.reward_lo <= reward <= acc.reward_hi:
                i = min(REWARD_BINS - 1, int((reward - acc.reward_lo) / (acc.reward_hi - acc.reward_lo) * REWARD_BINS))
                acc.rewards[i] += 1
            else:
                acc.out_of_range += 1
            p = acc.by_policy[version or "null"]
            p[0] += reward
            p[1] += 1
    return failed


def _throughput(acc: _Acc) -> dict[str, Any]:
    """Rollouts finished per bucket: `start` (epoch seconds) and `bucketSeconds` wide, at most THROUGHPUT_BUCKETS."""
    out: dict[str, Any] = {"start": None, "bucketSeconds": None, "counts": [], "total": sum(acc.ends.values()),
                           "unplaced": acc.unplaced}
    if not acc.ends:
        return out
    r = acc.resolution
    lo, hi = min(acc.ends) * r, (max(acc.ends) + 1) * r
    width = r
    while -(-(hi - lo // width * width) // width) > THROUGHPUT_BUCKETS:
        width *= 2
    start = lo // width * width
    counts = [0] * -(-(hi - start) // width)
    for k, n in acc.ends.items():
        counts[(k * r - start) // width] += n
    out.update(start=start, bucketSeconds=width, counts=counts)
    return out
