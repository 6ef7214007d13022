"""The trainer feed: the trajectories table, written once per final item and read in order (or followed).

`attempts` (a result, or a lease's expiry) calls `deliver`; the trainer routes read `trajectories`/`follow`/`groups`.
"""
from __future__ import annotations

import json
import sqlite3
import time
from typing import Any, AsyncIterator, Callable

from sqlalchemy.engine import Engine
from sqlmodel import Session, func, select

from rolloutd.crds.kit.aiokit import wait_event
from rolloutd.crds.trajectory import Trajectory

from ..dialects import PgRaw, insert_rows, int64, raw
from .job_state import Wakeups
from .hot_sql import Item
from .tables import FACT_REASON, REAL_MAX, ItemRow, TrajectoryRow


def facts(t: Trajectory) -> dict[str, Any]:
    """The columns beside a trajectory's document that the UI sums up (`tables.FACTS`)."""
    tm = t.timings
    return {"task_id": t.task_id, "policy": json.dumps(t.policy_version), "reason": t.failure.reason[:FACT_REASON],
            **{f"t_{stage}": real_fact(getattr(tm, stage)) for stage in ("queue", "init", "run", "eval")},
            "t_end": real_fact(tm.stamps.get("end")), **length_facts(t)}


FACT_COUNT_MAX = 2**31 - 1  # the count columns are 32-bit on PostgreSQL


def _count(value: Any) -> int | None:
    """A count a column can hold, else None (not counted): a node's metrics past it made its results call fail at
    every retry on either store (SQLite's integer stops at 2^63, PostgreSQL's at 2^31), stalling its job."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if -FACT_COUNT_MAX <= value <= FACT_COUNT_MAX else None  # NaN compares false: None


def real_fact(value: Any) -> float | None:
    """A reward or seconds the job's sums and means can take, else None (not counted): a node's NaN made the job's
    mean reward NaN on PostgreSQL (its status then failed validation: the job never finished), an infinity or 1e308
    made a sum infinite (the UI's JSON cannot hold it: a 500)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if -REAL_MAX <= value <= REAL_MAX else None  # NaN compares false: None


def length_facts(t: Trajectory) -> dict[str, Any]:
    """Generated tokens and turns (the agent loop's metrics, else the turns' own slices, segments' too), tool errors
    (its metric; None when not counted) and truncated (1: the rollout ended at the token limit)."""
    turns = [*t.turns, *(turn for seg in t.segments for turn in seg.turns)]
    m = t.metrics
    generated, n = _count(m.get("generated_tokens")), _count(m.get("turns"))
    return {"generated": _count(sum(x.generated_end - x.generated_start for x in turns)) if generated is None
            else generated, "turns": _count(len(turns)) if n is None else n,
            "tool_errors": _count(m.get("tool_errors")), "truncated": int(t.finish_reason == "length")}


def ordered(db: Any, jobs: set[str]) -> None:
    """PostgreSQL, before a transaction inserts trajectories of `jobs`: it holds each job's lock until it commits, so
    the job's seqs are committed in their order even when several replicas deliver (`shards.py`): a trainer that read
    seq n never finds a lower one committed later (a gap skipped). SQLite: its one writer does that already."""
    if isinstance(db, PgRaw):
        for job in sorted(jobs):  # in one order: two transactions never wait on each other's second lock
            db.execute("SELECT pg_advisory_xact_lock(hashtext(?))", (job,))


TRAJECTORIES = TrajectoryRow.__table__
FEED_COLUMNS = ("job", "item", "prompt", "sample", "reward", "failure", "data", "group_id", "task_id", "policy",
                "reason", "t_queue", "t_init", "t_run", "t_eval", "t_end", "generated", "turns", "tool_errors",
                "truncated")


class Feed:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.arrived = Wakeups()  # set when a job's trajectory is stored or its batch changes
        self.stopped = False

    def deliver(self, s: Session | None, item: ItemRow | Item, t: Trajectory,
                into: list[dict[str, Any]] | None = None) -> None:
        """Store `t` as the item's trajectory; with `into`, only append the row (the caller `insert`s
        a batch of them in one statement: an ORM object per row cost more than the JSON). The JSON is
        pydantic's own (in Rust), not `json.dumps` of a dict built in Python: the same document, for less."""
        if item.group_id is not None:
            t.group = item.group_id
        row = {"job": item.job, "item": item.id, "prompt": item.prompt, "sample": item.sample,
               "reward": real_fact(t.reward), "failure": t.failure.kind.value,
               "data": t.model_dump_json(by_alias=True), "group_id": item.group_id, **facts(t)}
        if row["t_end"] is None:  # no end stamp (the controller's own infra failures) or none a column holds: now
            row["t_end"] = time.time()
        if into is None:
            ordered(raw(s.connection()), {item.job})
            s.add(TrajectoryRow(**row))
        else:
            into.append(row)
        self.arrived.set(item.job)

    @staticmethod
    def insert(db: sqlite3.Connection, rows: list[dict[str, Any]]) -> None:
        """The rows `deliver` collected, in one statement, in order (their seqs follow it)."""
        ordered(db, {r["job"] for r in rows})
        insert_rows(db, TRAJECTORIES, FEED_COLUMNS, [tuple(r[c] for c in FEED_COLUMNS) for r in rows])

    def trajectories(self, job: str, cursor: int = 0, limit: int = 1000) -> list[tuple[int, str]]:
        with Session(self.engine, expire_on_commit=False) as s:
            q = (select(TrajectoryRow.seq, TrajectoryRow.data)
                 .where(TrajectoryRow.job == job, TrajectoryRow.seq > int64(cursor))
                 .order_by(TrajectoryRow.seq).limit(limit))
            return list(s.exec(q).all())

    async def follow(self, job: str, cursor: int, finished: Callable[[], bool],
                     timeout: float | None = None) -> AsyncIterator[tuple[int, str]]:
        """Every trajectory after `cursor`, as it arrives, until the job is finished and all are sent."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            ev = self.arrived.event(job)
            ev.clear()
            rows = self.trajectories(job, cursor)
            for seq, data in rows:
                cursor = seq
                yield seq, data
            if rows:
                continue
            if finished() or self.stopped:
                if not self.trajectories(job, cursor, 1):
                    return
                continue
            wait = 5.0 if deadline is None else min(5.0, deadline - time.monotonic())
            if wait <= 0:
                return
            if not await wait_event(ev, wait):
                yield 0, ""  # keep-alive tick

    def outcomes(self, job: str) -> tuple[dict[str, int], float | None]:
        """The job's delivered trajectories by failure kind (none, agent, infra, config) and the mean reward of
        the scored ones (None before the first); infrastructure failures carry no reward and are left out."""
        with Session(self.engine, expire_on_commit=False) as s:
            rows = s.exec(select(TrajectoryRow.failure, func.count(), func.sum(TrajectoryRow.reward),
                                 func.count(TrajectoryRow.reward))
                          .where(TrajectoryRow.job == job).group_by(TrajectoryRow.failure)).all()
        kinds = {kind: n for kind, n, _, _ in rows}
        total = sum(t or 0.0 for kind, _, t, _ in rows if kind != "infra")
        rewarded = sum(r for kind, _, _, r in rows if kind != "infra")
        return kinds, (round(total / rewarded, 4) if rewarded else None)

    def last_reason(self, job: str, kind: str) -> str:
        """The failure reason of the job's latest trajectory of failure `kind` ("" when there is none)."""
        with Session(self.engine, expire_on_commit=False) as s:
            data = s.exec(select(TrajectoryRow.data).where(TrajectoryRow.job == job, TrajectoryRow.failure == kind)
                          .order_by(TrajectoryRow.seq.desc()).limit(1)).first()
        return "" if data is None else str(json.loads(data).get("failure", {}).get("reason", ""))

    def groups(self, job: str, samples: int) -> list[dict[str, Any]]:
        with Session(self.engine, expire_on_commit=False) as s:
            rows = s.exec(select(TrajectoryRow).where(TrajectoryRow.job == job)
                          .order_by(TrajectoryRow.prompt, TrajectoryRow.sample)).all()
        out: dict[int, dict[str, Any]] = {}
        for r in rows:
            g = out.setdefault(r.prompt, {"prompt": r.prompt, "samples": [], "rewards": [], "complete": False})
            g["samples"].append(json.loads(r.data))
            g["rewards"].append(r.reward)
        for g in out.values():
            g["complete"] = len(g["samples"]) == samples
        return [out[k] for k in sorted(out)]

    def stop(self) -> None:
        self.stopped = True
        self.arrived.set_all()
