"""Policy versions: the version every lease and beat carries, and the switch to a new one around weight sync.

Called by the policy routes (`announce`, `describe`); `attempts` reads the version (a lease) and measures a result's
staleness against the history (`staleness.staleness`). An announce's timeline is `policy_steps.Steps`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3
import time
import uuid
from collections import defaultdict
from typing import Any, Awaitable, Callable

from sqlalchemy.engine import Engine
from sqlmodel import Session

from rolloutd.crds.kit.aiokit import wait_event
from rolloutd.crds.node import PolicyState, PolicyWatch
from rolloutd.crds.weight_labels import foreign_version, weight_label

from ..errors import ServiceUnavailable
from .backend_http import BackendHttp
from .hot_sql import policy_ahead
from .job_state import Jobs
from .node_registry import NodeRegistry
from .policy_steps import Steps
from .tables import PolicyRow

log = logging.getLogger("rolloutd.scheduler")


class PolicyVersions:
    def __init__(self, engine: Engine, jobs: Jobs, nodes: NodeRegistry, http: BackendHttp,
                 wake: Callable[[str], None], settle: Callable[[], Awaitable[None]] | None = None) -> None:
        self.engine, self.jobs, self.nodes, self.http, self.wake = engine, jobs, nodes, http, wake
        self.settle = settle or _nothing  # the store's sync (`Durable.settle`): the announce's answer waits for it
        self._llm: dict[str, tuple[float, int, bool, int]] = {}  # node id → (beat time, calls in flight, held, fence)
        self._fences: dict[str, int] = defaultdict(int)  # job → the keep-mode fence the daemons are asked to take
        self._behind: dict[str, dict[str, Any]] = {}  # job → {backend url: the older version it still runs}
        self._lock: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        # `describe` every second for each live dashboard read the row (~1 ms on a connection the nodes' commits left
        # cold): kept with the job's count of policy writes (`_changed`), read before the row
        self._writes: dict[str, int] = defaultdict(int)
        self._described: dict[str, tuple[int, dict[str, Any]]] = {}
        # policy-watch: a job's epoch counts its policy's changes (row writes, fences) in this process (`instance`);
        # a watch waits on the job's event, set and replaced at each change
        self.instance = uuid.uuid4().hex[:16]
        self._epoch: dict[str, int] = defaultdict(int)
        self._moved: dict[str, asyncio.Event] = {}
        self._watch_seq: dict[str, int] = {}  # node → the last report its watches carried (the beats' are ignored)
        self._waiting: set[asyncio.Event] = set()  # `_wait_beats`' wake-ups: set by each daemon's report
        self.stopping = False  # `stop`: the watches end at once, answered 503

    def row(self, s: Session, job: str) -> PolicyRow:
        """The job's policy row, created (and flushed) on first use."""
        row = s.get(PolicyRow, job)
        if row is None:
            row = PolicyRow(job=job)
            s.add(row)
            s.flush()
        return row

    def raw_row(self, db: sqlite3.Connection, job: str, sent: Callable[[], Any] | None = None) -> tuple[str, str, bool]:
        """`row` as its raw columns on a DB-API connection (version JSON, history JSON, paused), created on first use
        (ON CONFLICT: on PostgreSQL another transaction may create it meanwhile; SQLite, one writer at a time, never
        races). `sent`: its read, sent earlier (`hot_sql.policy_ahead`: it shared a round trip with the reads after
        it)."""
        row = (sent or policy_ahead(db, job))()
        if row is None:
            default = PolicyRow(job=job)
            db.execute("INSERT INTO policies (job, version, history, paused) VALUES (?, ?, ?, ?) "
                       "ON CONFLICT (job) DO NOTHING", (job, default.version, default.history, default.paused))
            row = policy_ahead(db, job)()
        return row[0], row[1], bool(row[2])

    def version(self, job: str) -> int | str | None:
        with Session(self.engine, expire_on_commit=False) as s:
            row = s.get(PolicyRow, job)
            return json.loads(row.version) if row else None

    def describe(self, job: str) -> dict[str, Any]:
        self.jobs.store.get(job)  # 404 for unknown jobs
        writes = self._writes[job]
        kept = self._described.get(job)
        if kept is not None and kept[0] == writes:
            return kept[1]
        with Session(self.engine, expire_on_commit=False) as s:
            row = s.get(PolicyRow, job) or PolicyRow(job=job)
            out = {"version": json.loads(row.version), "history": json.loads(row.history), "paused": row.paused}
        self._described[job] = (writes, out)
        return out

    def _changed(self, job: str) -> None:
        """After a commit to the job's policy row (or its deletion): `describe` reads it again."""
        self._writes[job] += 1
        self._described.pop(job, None)
        self._epoch[job] += 1
        moved = self._moved.pop(job, None)
        if moved is not None:
            moved.set()

    def forget(self, job: str) -> None:
        self._changed(job)

    def note_beat(self, node_id: str, llm_inflight: int, llm_held: bool, llm_fence: int = 0) -> None:
        """A daemon's beat: how many LLM calls it has in flight, whether it holds new ones, its last fence. A daemon
        that watches reports on its watches (`watch`), never older than a beat that could arrive after them."""
        if node_id not in self._watch_seq:
            self._llm[node_id] = (time.monotonic(), llm_inflight, llm_held, llm_fence)
            _wake(self._waiting)

    async def watch(self, node_id: str, job: str, req: PolicyWatch) -> PolicyState:
        """A daemon's policy watch (feature policy-watch): note its report as a beat's, then answer the job's policy
        once it differs from the epoch the daemon knows, `req.wait` seconds at most."""
        if req.seq >= self._watch_seq.get(node_id, -1):  # two watches may arrive out of order: the newer report
            self._watch_seq[node_id] = req.seq
            self._llm[node_id] = (time.monotonic(), req.llm_inflight, req.llm_held, req.llm_fence)
            _wake(self._waiting)
        deadline = time.monotonic() + req.wait
        while req.instance == self.instance and req.epoch == self._epoch[job] and not self.stopping:
            if not await wait_event(self._moved.setdefault(job, asyncio.Event()), deadline - time.monotonic()):
                break
        if self.stopping and req.wait > 0:  # a report (wait 0) is answered as ever
            raise ServiceUnavailable("the controller is stopping: watch again once it is back")
        epoch = self._epoch[job]  # read before the state: a change in between makes the next watch answer at once
        policy = self.describe(job)
        fence, behind = self.fence(job)
        return PolicyState(instance=self.instance, epoch=epoch, policy_version=policy["version"],
                           llm_paused=policy["paused"], llm_fence=fence, backend_versions=behind)

    def stop(self) -> None:
        """The controller stops: each watch is answered 503 now, not cut at the server's graceful timeout (5 s)."""
        self.stopping = True
        for moved in self._moved.values():
            moved.set()

    def fence(self, job: str) -> tuple[int, dict[str, Any]]:
        """What a beat's reply tells the daemons: the fence to take, the backends behind the job's version."""
        return self._fences[job], self._behind.get(job, {})

    def _set(self, job: str, **changes: Any) -> None:
        with Session(self.engine, expire_on_commit=False) as s:
            row = self.row(s, job)
            for k, v in changes.items():
                setattr(row, k, v)
            s.add(row)
            s.commit()
        self._changed(job)

    async def announce(self, name: str, version: int | str, weights_path: str | None = None,
                       pause: bool | None = None, drain_timeout: float = 120.0) -> dict[str, Any]:
        """Switch the job to policy `version` in its `spec.policy.updateMode`. drain: hold new LLM calls on every
        daemon, wait for the in-flight ones to finish, then on every backend pause → reload weights → reset the
        prefix cache → resume (no request spans two versions). keep / abort: `_live`, which waits for one beat
        of each daemon, never for a generation; requests in flight continue on the new weights and the daemons
        record where (versionSpans). Returns once every backend runs the new version or
        has failed to load it (reported; it keeps its version and the daemons tag its tokens with that), and the
        policy row's commit is on the disk (`settle`: the route answers without another sync)."""
        job = self.jobs.get(name)
        mode = job.spec.policy.update_mode
        pause = job.spec.policy.pause_on_update if pause is None else pause
        async with self._lock[name]:
            t0 = time.monotonic()
            steps = Steps(t0)
            label = weight_label(name, job.metadata.uid, version)
            drained = True
            urls = list(self.jobs.sync(job).backends)
            if mode == "drain":
                if pause:
                    self._set(name, paused=True)
                    drained = await self._wait_beats(name, time.monotonic(), drain_timeout, lambda b: b[2] and b[1] == 0)
                    steps.mark("drained")
                t_engines = time.monotonic()
                report = list(await asyncio.gather(*(self.http.update(url, weights_path, pause, label) for url in urls)))
                engines = time.monotonic() - t_engines
                steps.mark("resumed")
                self._commit(name, version, weights_path, report)
                steps.mark("committed")
                await self.settle()
                steps.mark("synced")
            else:
                drained, report, engines = await self._live(name, version, urls, weights_path, mode, drain_timeout,
                                                            steps, label)
        errors = [b for b in report if b.get("error")]
        if errors:
            log.warning("policy %s of %s: %d backend(s) failed: %s", version, name, len(errors), errors)
        return {"version": version, "mode": mode, "pausedSeconds": round(time.monotonic() - t0, 3),
                "enginesPausedSeconds": round(engines, 3), "steps": steps.out,
                "drained": drained, "backends": report}

    def _commit(self, name: str, version: int | str, weights_path: str | None, report: list[dict[str, Any]],
                tell: bool = True) -> Any:
        """The job runs `version` from now on: the backends that failed to load it (`report`) stay behind on what they
        ran, the policy row (version, history, not paused) is committed, and, with `tell`, the daemons are told
        (`_tell`). Returns the version the job ran before."""
        behind = dict(self._behind.get(name, {}))
        with Session(self.engine, expire_on_commit=False) as s:
            row = self.row(s, name)
            before = json.loads(row.version)
            for b in report:  # a backend that failed to load runs what it ran before
                if b.get("error"):
                    behind[b["url"]] = behind.get(b["url"], before)
                else:
                    behind.pop(b["url"], None)
            self._behind[name] = behind
            history = json.loads(row.history)
            if version not in history:
                history.append(version)
            row.version, row.history, row.paused = json.dumps(version), json.dumps(history), False
            s.add(row)
            s.commit()
        if tell:
            self._tell(name, version, weights_path, report)
        return before

    def _tell(self, name: str, version: int | str, weights_path: str | None, report: list[dict[str, Any]]) -> None:
        """The daemons' watches answered (and leasing woken) with the committed version."""
        self._changed(name)
        self.wake(name)
        if weights_path:
            self._tag_sharers(name, version, [b["url"] for b in report if b.get("reloaded") and not b.get("error")])

    def _tag_sharers(self, name: str, version: int | str, reloaded: list[str]) -> None:
        """Other jobs listing a backend that just loaded `name`'s weights: their daemons tag what it generates from
        now on as `name@version` (a version not in their history, so their staleness bound counts it as too old),
        until their own announce loads their weights there again. Their calls in flight at the reload are not
        fenced: they carry their own version to the end of the call (docs/content/async.md, shared backends)."""
        for other in self.jobs.names():
            cache = self.jobs.cached(other)
            shared = set(reloaded) & set(cache.backends) if cache is not None and other != name else set()
            if shared:
                self._behind.setdefault(other, {}).update({u: foreign_version(name, version) for u in shared})
                self._changed(other)

    async def _live(self, name: str, version: int | str, urls: list[str], weights_path: str | None, mode: str,
                    timeout: float, steps: Steps, label: str) -> tuple[bool, list[dict[str, Any]], float]:
        """Pause every engine (keep: its requests in place; abort: aborting them, the daemons keep their tokens and
        continue them once the gate opens) while the daemons are asked to hold new LLM calls (the hold's commit
        overlaps the pause; a stream the engine aborts under a held gate parks at once). Once paused, load the weights,
        label them and reset the prefix cache, including the kept requests' KV (recomputed on the new weights), while
        the daemons are asked to take a fence: where each of their streams stands (the tokens before it are the old
        version's: read from the stamps for a stream the engine stamps; any other is aborted and continued from its
        tokens so far, as in abort mode; a request that reached the engine after the pause stands at 0). Once every
        daemon has taken the fence and every engine has loaded, commit the new version (`_commit`), then resume the
        engines while that commit is synced (`settle`), and tell the daemons (`_tell`). Returns (every daemon
        answered, the per-backend report, the seconds from the first pause to the last resume).

        Why the commit may come before the resume: the engines are paused (a request sent to one queues there, its
        tokens made after the resume, on the loaded and labelled weights), so a daemon that learns the new version
        from the row before it is told (a lease, a beat) tags nothing with it that it did not generate. And why the
        resume may come before the sync: every record that names the new version (a result tagged with it) is
        committed after the policy row, and is acknowledged only once a sync that started after its own commit is
        done (the node protocol settles results before it answers), which syncs the WAL up to it, the row's commit
        included (the WAL is synced in order; `durability.py`). A crash before that sync loses the row and every unacknowledged
        result with it: the trainer had no 2xx, the nodes send their results again
        (tests/controller/work/test_policy_commit.py)."""
        t_engines = time.monotonic()
        # abort: the pause also clears the prefix cache (explicitly), and nothing is computed until the resume
        how = {"mode": mode, "clear_cache": "true"} if mode == "abort" else {"mode": mode}
        pausing = asyncio.ensure_future(asyncio.gather(*(self.http.post(u, "/pause", how) for u in urls)))
        await asyncio.sleep(0)  # the pause calls go out before the hold's commit below holds the loop
        self._set(name, paused=True)  # the daemons hold new calls while the engines pause
        steps.mark("hold")
        paused = await pausing
        steps.mark("paused")

        async def load() -> list[dict[str, Any]]:
            out = await asyncio.gather(*(self.http.load(u, weights_path, running=mode == "keep", label=label,
                                                        reset=mode != "abort")
                                         for u, why in zip(urls, paused) if why is None))
            steps.mark("loaded")
            return out
        loading = asyncio.ensure_future(load())
        self._fences[name] += 1  # asked only now: the fence must follow the pause (see `PolicyGate._fence`)
        epoch = self._fences[name]
        self._changed(name)  # the watches answer with it (the hold is committed already)
        since = time.monotonic()
        steps.mark("asked")
        held = asyncio.ensure_future(self._wait_beats(name, since, timeout, lambda b: b[2], steps.nodes("held")))
        fenced = asyncio.ensure_future(self._wait_beats(name, since, timeout, lambda b: b[2] and b[3] >= epoch,
                                                        steps.nodes("fenced")))
        loads = await loading
        answered = await fenced
        held.cancel()
        steps.mark("fenced")
        by_url = {b["url"]: b for b in loads}
        report = [by_url.get(u) or {"url": u, "reloaded": False, "error": why} for u, why in zip(urls, paused)]
        before = self._commit(name, version, weights_path, report, tell=False)
        steps.mark("committed")

        async def resume() -> list[str | None]:
            out = await asyncio.gather(*(self.http.post(u, "/resume") for u in urls))
            steps.mark("resumed")
            return out

        async def sync() -> None:
            await self.settle()
            steps.mark("synced")
        resumed, _ = await asyncio.gather(resume(), sync())
        engines = time.monotonic() - t_engines
        failed = False
        for b, why in zip(report, resumed):
            if why and not b["error"]:
                b["error"], failed = why, True
        if failed:  # paused still (it generates nothing): reported, and behind on what it ran before
            for b in report:
                if b["error"]:
                    self._behind[name].setdefault(b["url"], before)
        # the daemons are told once the engines resumed: the calls they send then (abort: every stream's continuation)
        # would otherwise queue ahead of the resumes at the engines' API servers
        self._tell(name, version, weights_path, report)
        return answered, report, engines

    async def _wait_beats(self, name: str, since: float, timeout: float, ok: Callable[[tuple], bool],
                          when: dict[str, float] | None = None) -> bool:
        """True once every active daemon of the job beat after `since` and its beat (time, in flight, held, fence)
        satisfies `ok`; False after `timeout` (logged). `when` gets each daemon's first such report's time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            beats = {n: self._llm.get(n) for n in self.nodes.active(name)}
            good = {n: b for n, b in beats.items() if b is not None and b[0] > since and ok(b)}
            if when is not None:
                for n, b in good.items():
                    when.setdefault(n, b[0])
            if len(good) == len(beats):
                return True
            # woken by the next report; the daemons' set is looked at again every 50 ms
            await _next_report(self._waiting, min(0.05, max(deadline - time.monotonic(), 0)))
        log.warning("policy update of %s: daemons did not answer as asked within %.0f s", name, timeout)
        return False



async def _nothing() -> None:
    return None


def _wake(waiting: set[asyncio.Event]) -> None:
    """A daemon reported (a beat, a watch): every `_next_report` returns."""
    for woken in waiting:
        woken.set()


async def _next_report(waiting: set[asyncio.Event], seconds: float) -> None:
    """Until the next daemon report (`_wake`), `seconds` at most."""
    woken = asyncio.Event()
    waiting.add(woken)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(woken.wait(), seconds)
    finally:
        waiting.discard(woken)
