"""The data of the UI's live pages (the jobs list, a job's page), built on the event loop in slices.

Called by `ui/app.py` for the JSON routes and their server-sent events. The controller is one asyncio process: a
build holds whatever thread runs it, and a build in a worker thread (as before) held the GIL the event loop needs
for the nodes' calls, so each of the loop's GIL hand-overs (every SQLite statement, every socket call) could wait
a switch interval (5 ms) behind it. So a build runs on the loop itself and yields to it (`await asyncio.sleep(0)`)
after every bounded step: a statement, CHUNK rows summed (`work/stats.JobStats.numbers`), NODE_CHUNK node rows
made and encoded. A node call waits behind one step at most.

Each job's summary is built once for every page open on it (one task, shared) and kept as encoded bytes, the JSON
and the SSE frame, sent as they are to each client. It is built again when a page asks after
    max(SUMMARY_SECONDS, BUILD_SHARE × the CPU its slices took, BUSY_SECONDS when the controller is busy)
where busy means its event loop lagged BUSY_LAG or more within the last 5-10 s (`looplag.LoopLag.recent_max`): a
controller already late for its nodes refreshes its dashboards every BUSY_SECONDS instead of every second. The jobs
list is built the same way, once for every principal (each sees the rows it may read).
A build carries the job's node counts by state and the NODES_SHOWN nodes that most need a look (not active, then
the longest silent); the whole table is a page at a time from `nodes`, when the page asks for it.
Next step: throughput per node.
"""
from __future__ import annotations

import asyncio
import heapq
import json
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Awaitable, Callable, TypeVar

from rolloutd.crds.names import TERMINAL_PHASES as FINAL_PHASES
from rolloutd.crds.errors import ConfigurationError
from rolloutd.crds.names import job_key

from ..errors import ApiError
from ..store import Store
from ..work import stats
from ..work.backends import BackendPool
from ..work.held_leases import HeldLeases
from ..work.node_registry import NodeRegistry
from ..work.scheduler import Scheduler

SUMMARY_SECONDS = 1.0
BUILD_SHARE = 20  # built at most once per 20 × its slices' CPU: ≤ 5 % of a core per job
BUSY_SECONDS = 5.0
BUSY_LAG = 0.05
NODE_CHUNK = 250  # node rows made and encoded per slice (~0.4 ms)
NODES_SHOWN = 50  # node rows in a live build: 1000 of them every second made the document ~130 kB for each page
EVENTS_SHOWN = 50  # a job's newest events in a live build (the page lists 50; the API's …/events has them all)
T = TypeVar("T")


@dataclass(frozen=True)
class WorkView:
    """What the web UI reads of the work core (`work/core.Work`): the backends' view, the nodes' listing, the leases
    held and the clock; built by the composition's API (`api.py`)."""
    pool: BackendPool
    registry: NodeRegistry
    leases: HeldLeases
    clock: Callable[[], float]


@dataclass
class Built:
    """One build, encoded once: `body` the JSON document, `frame` the same as one server-sent event."""
    version: int
    body: bytes
    frame: bytes
    due: float  # monotonic time after which a page's request builds it again


class JobGone(ConfigurationError):
    """The job is not there (or no longer): `code` and `message` for the page."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def rate(status: dict[str, Any]) -> tuple[float | None, float | None]:
    """Rollouts per second since the job started, and the seconds left at that rate (None when unknown)."""
    counts, start = status.get("counts") or {}, status.get("startTime")
    if not start:
        return None, None
    begin = datetime.fromisoformat(start.replace("Z", "+00:00")).timestamp()
    end = status.get("completionTime")
    now = datetime.fromisoformat(end.replace("Z", "+00:00")).timestamp() if end else time.time()
    done = counts.get("succeeded", 0) + counts.get("failed", 0) + counts.get("cancelled", 0)
    if now - begin <= 0 or done == 0:
        return None, None
    per_second = done / (now - begin)
    left = max(counts.get("total", 0) - done, 0)
    return round(per_second, 3), (round(left / per_second, 1) if not end else 0.0)


def _attention(row: tuple) -> tuple:
    """The order of the nodes shown live: those not active first, then the longest silent, then by name."""
    _id, name, _host, state, _slot, seen = row
    return (state == "active", seen, name)


def node_rows(held: Callable[[str], int], listing: list[tuple]) -> str:
    """`listing` (`NodeRegistry.listing` rows) as a JSON array of the page's node rows; `held(node)`: its leases."""
    now = time.time()
    return json.dumps([{"id": i, "name": n, "host": h, "state": st, "slot": slot, "inflight": held(i),
                        "secondsSinceBeat": round(now - seen, 1)} for i, n, h, st, slot, seen in listing])


class _Slices:
    """The CPU of a build's own slices (the loop's other work between them not counted), and the pause between;
    `observe` gets each slice's CPU time (how long it held the loop, a busy machine's preemption left out)."""

    def __init__(self, observe: Callable[[float], None]) -> None:
        self.observe, self.cpu = observe, 0.0
        self._t = time.thread_time()

    async def pause(self) -> None:
        await self.wait(asyncio.sleep(0))

    async def wait(self, other: Awaitable[T]) -> T:
        """`other` awaited outside the build's slices (what runs meanwhile is not the build's)."""
        self.end()
        try:
            return await other
        finally:
            self._t = time.thread_time()

    def end(self) -> None:
        step = time.thread_time() - self._t
        self.cpu += step
        self.observe(step)
        self._t = time.thread_time()


class LivePages:
    """The live pages' data, one shared build per job (and one per principal's jobs list) at a time."""

    def __init__(self, store: Store, job_stats: stats.JobStats, scheduler: Scheduler | None = None,
                 work: WorkView | None = None, busy: Callable[[], float] | None = None,
                 observe_step: Callable[[float], None] | None = None):
        """`scheduler`, `work`: the root's (None: a controller without a scheduler shows no numbers or nodes)."""
        self.store, self.scheduler, self.work, self.job_stats = store, scheduler, work, job_stats
        self.busy = busy or (lambda: 0.0)  # the loop's recent largest lag, in seconds
        self.observe_step = observe_step or (lambda seconds: None)  # each slice a build held the loop
        self._built: dict[str, Built] = {}
        self._documents: dict[str, tuple[int, dict[str, Any], list[dict[str, Any]]]] = {}  # key → (mark, job, events)
        self._building: dict[str, asyncio.Future] = {}
        self._versions = 0

    async def get(self, key: str, make: Callable[[_Slices], Any]) -> Built:
        """The build kept under `key`, made again (by `make`, once for every caller of the moment) when due."""
        hit = self._built.get(key)
        if hit is not None and time.monotonic() < hit.due:
            return hit
        task = self._building.get(key)
        if task is None:
            task = self._building[key] = asyncio.ensure_future(self._make(key, make))
            task.add_done_callback(lambda t: self._building.pop(key) if self._building.get(key) is t else None)
        return await asyncio.shield(task)  # a page that goes away does not stop the build the others wait for

    async def _make(self, key: str, make: Callable[[_Slices], Any]) -> Built:
        t0, slices = time.monotonic(), _Slices(self.observe_step)
        body = await make(slices)
        slices.end()
        self._versions += 1
        wait = max(SUMMARY_SECONDS, BUILD_SHARE * slices.cpu, BUSY_SECONDS if self.busy() >= BUSY_LAG else 0.0)
        built = self._built[key] = Built(self._versions, body, b"data: " + body + b"\n\n", t0 + wait)
        return built

    # ------------------------------------------------------------ a job's page

    def job(self, key: str, namespace: str, name: str) -> Awaitable[Built]:
        return self.get("job " + key, lambda slices: self._job(slices, key, namespace, name))

    async def _document(self, key: str, namespace: str, name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The job and its last EVENTS_SHOWN events, read again only after the store marked a change to either:
        read afresh, the two cost ~3 ms each second (the nodes' commits leave the connections' page caches cold),
        most of a build at a hundred nodes. Read in a worker thread: a stalled database holds this page, never the
        loop that answers the nodes and every other call (tests/faults/test_ui_database_stall.py)."""
        mark = self.store.mark_of(key)  # before the reads: a change meanwhile makes the next build read again
        kept = self._documents.get(key)
        if kept is not None and kept[0] == mark:
            return kept[1], kept[2]
        try:
            job, events = await asyncio.to_thread(self._read, key, namespace, name)
        except ApiError as e:
            self._built.pop("job " + key, None)
            self._documents.pop(key, None)
            self.job_stats.forget(key)  # a page open while its job was deleted made its sums again: not kept
            raise JobGone(e.code, e.message) from None
        self._documents[key] = (mark, job, events)
        return job, events

    def _read(self, key: str, namespace: str, name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        return self.store.get_wire(name, namespace), self.store.events(key, last=EVENTS_SHOWN)

    async def _job(self, slices: _Slices, key: str, namespace: str, name: str) -> bytes:
        job, events = await slices.wait(self._document(key, namespace, name))  # the loop's work meanwhile is not ours
        status, scheduler, work = job.get("status") or {}, self.scheduler, self.work
        per_second, eta = rate(status)
        uid = job["metadata"]["uid"]
        out: dict[str, Any] = {"namespace": namespace, "name": name, "uid": uid,
                               "phase": status.get("phase", "Pending"), "status": status,
                               "rolloutsPerSecond": per_second, "etaSeconds": eta, "events": events,
                               "tokenizer": (job["spec"].get("llm") or {}).get("tokenizer"),
                               "trajectories": None, "backends": []}
        await slices.pause()
        parts: list[str] = []
        if scheduler is not None and work is not None:
            numbers = await slices.wait(self.job_stats.numbers(key, uid, finished=status.get("phase") in FINAL_PHASES))
            out["trajectories"] = numbers["counts"]
            out.update(numbers["summary"])
            out["backends"] = work.pool.view(key, [b["url"] for b in (job["spec"].get("llm") or {}).get("backends", [])])
            out["policy"] = {**scheduler.policy(key), "spec": job["spec"].get("policy") or {}}
            await slices.pause()
            listing = work.registry.listing(key)
            await slices.pause()
            out["nodesTotal"], out["nodeStates"] = len(listing), dict(Counter(row[3] for row in listing))
            parts.append(node_rows(work.leases.held, heapq.nsmallest(NODES_SHOWN, listing, key=_attention))[1:-1])
        head = json.dumps(out)
        return (head[:-1] + ', "nodes": [' + ", ".join(parts) + "]}").encode()

    # ------------------------------------------------------------ a job's nodes, all of them

    async def nodes(self, key: str, offset: int, limit: int) -> bytes:
        """A page of the job's nodes by name (`offset`, `limit`), and how many there are; built when asked, never
        in the live build, which carries only the NODES_SHOWN that most need a look."""
        work = self.work
        listing = sorted(work.registry.listing(key), key=lambda row: (row[1], row[0])) if work is not None else []
        page, parts = listing[offset:offset + limit], []
        for start in range(0, len(page), NODE_CHUNK):
            await asyncio.sleep(0)
            parts.append(node_rows(work.leases.held, page[start:start + NODE_CHUNK])[1:-1])
        return ('{"total": %d, "offset": %d, "items": [' % (len(listing), offset) + ", ".join(p for p in parts if p)
                + "]}").encode()

    # ------------------------------------------------------------ the jobs list

    def jobs(self, principal) -> Awaitable[Built]:
        scope = principal.scoped and principal.scoped.namespaces
        return self.get(f"jobs {principal.name} {scope}", lambda slices: self._jobs(slices, principal))

    async def _jobs(self, slices: _Slices, principal) -> bytes:
        items = []
        for job in (await slices.wait(asyncio.to_thread(self.store.list_wire)))[0]:  # off the loop, as `_document`'s
            meta, status = job["metadata"], job.get("status") or {}
            if principal.may_read(meta["namespace"], meta["name"]):
                continue
            await slices.pause()
            per_second, eta = rate(status)
            counts = (await slices.wait(self.job_stats.numbers(job_key(meta["namespace"], meta["name"]), meta["uid"],
                                                               finished=status.get("phase") in FINAL_PHASES,
                                                               summary=False)))["counts"]
            items.append({"namespace": meta["namespace"], "name": meta["name"], "phase": status.get("phase", "Pending"),
                          "counts": status.get("counts") or {}, "rolloutsPerSecond": per_second, "etaSeconds": eta,
                          "rewardMean": counts["rewardMean"], "infraRate": counts["infraRate"],
                          "delivered": counts["delivered"], "policyVersion": status.get("policyVersion"),
                          "message": status.get("message", "")})
        return json.dumps({"items": items}).encode()

