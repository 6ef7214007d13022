"""Batch mode and DAPO dynamic sampling: which prompts run, which groups count, when to stop.

The scheduler calls `request`/`snapshot` (batch API), `attempts` calls `group_settled` (a result or an expiry
settles a group); items go via `Items` (`queue`).

A job is in batch mode when `spec.dapo.enabled` or `spec.batches` is set; a trainer asks for batch k and
the job opens groups (one prompt × samplesPerPrompt each, prompts in dataset order, cycling,
the cursor persisted) until k is full:

- plain batches: a group counts when all its samples are scored;
- DAPO: a group counts only when *informative* (rewards not all equal, or the mean inside
  `dapo.band`); a non-informative group is replaced at once by the next prompt (asynchronous
  replenishment), with up to `maxInFlightGroups` groups running.

A sample that failed for infrastructure reasons (after its retries) makes its group
`incomplete`: it never counts and is never padded with a reward. When the batch is full every
surplus rollout is cancelled on the daemons (the next heartbeat, ≤ 0.5 s) — or, with
`carryOver`, its group moves to the next batch and keeps running.

A trainer that picks its own prompts (TRL's GRPOTrainer: `rolloutd.integrations.trl`) names them
when it requests a batch (`prompts`: dataset indices, one group each, repeats allowed; plain
batches only): exactly those groups run, none is replaced, and the batch completes when every one
has settled — an incomplete group (infrastructure failure) stays in it for the trainer to see.

Who writes a batch's groups: the event loop (`group_settled` from results and expiries, the staleness sweep) and,
while a large batch opens, a worker thread (`fill` a step at a time, issue 36: on the loop it held every tenant's
calls). The item queue's state assumes one writer at a time, so each of them first takes the transaction's write
lock on the batch (`hold`: SQLite's database lock, PostgreSQL's batch row), then `Batches.lock`, always in that
order (the other order deadlocks against a group commit holding the database lock).
"""
from __future__ import annotations

import json
import statistics
import threading
from types import SimpleNamespace
from typing import Any, Callable, Protocol

from sqlalchemy.orm.attributes import set_committed_value
from sqlmodel import Session, select

from rolloutd.crds.rolloutjob import RolloutJob

from ..dialects import raw
from ..errors import BadRequest, Conflict, Forbidden, NotFound
from . import opened
from .held_leases import HeldLeases
from .states import LIVE, BatchState, GroupState, ItemState
from .tables import BatchPromptsRow, BatchRow, GroupRow, ItemRow, TrajectoryRow


class Items(Protocol):
    """What batches need of the item queue (`queue.ItemQueue`): add groups' items, cancel one, wake leasing,
    and the leases held (`leases`: where a leased item's stage is)."""

    clock: Callable[[], float]
    leases: HeldLeases

    def add_groups_items(self, s: Session, job: str, group_ids: list[int], samples: int, now: float) -> None: ...

    def cancel_item(self, item: ItemRow) -> None: ...

    def wake(self, job: str) -> None: ...


CHUNK_ITEMS = 32  # rollouts opened per step (`fill`): a step holds the event loop for tens of milliseconds at most
_PLAIN = ("state", "target", "counted", "opened_groups")  # what a step of the fill thread reads of its batch (`hold`)
ItemQuota = Callable[[RolloutJob], "int | None"]  # a job's quotas.itemsPerJob (None: unrestricted)


def batch_target(job: RolloutJob) -> int:
    spec = job.spec
    return spec.dapo.target_groups if spec.dapo.enabled else spec.batches.groups


def max_in_flight(job: RolloutJob) -> int:
    spec = job.spec
    if spec.dapo.enabled:
        return spec.dapo.max_in_flight_groups or 2 * spec.dapo.target_groups
    return spec.batches.max_in_flight_groups or spec.batches.groups


def carry_over(job: RolloutJob) -> bool:
    spec = job.spec
    return spec.dapo.carry_over if spec.dapo.enabled else spec.batches.carry_over


def incomplete_limit(target: int) -> int:
    """Groups a batch may lose to infrastructure failures before it fails instead of replacing them."""
    return 2 * target + 4


def informative(job: RolloutJob, rewards: list[float]) -> bool:
    if not job.spec.dapo.enabled:
        return True
    if job.spec.dapo.filter == "band" and job.spec.dapo.band is not None:
        lo, hi = job.spec.dapo.band
        return lo <= statistics.fmean(rewards) <= hi
    return max(rewards) != min(rewards)


class Batches:
    """Helpers over the batch tables; callers pass their session. `prompts(job)`: the job's dataset rows."""

    def __init__(self, items: Items, prompts: Callable[[RolloutJob], int],
                 item_quota: ItemQuota = lambda job: None,
                 gate: Callable[[Session, RolloutJob, int], int] | None = None) -> None:
        """`gate(s, job, n)`: how many of `n` groups the job may open now (the staleness bound's capacity)."""
        self.items, self.prompts, self.item_quota, self.gate = items, prompts, item_quota, gate
        self.lock = threading.RLock()  # one writer of the groups at a time: the loop or the fill thread

    def hold(self, s: Session, name: str, k: int, plain: bool = False) -> BatchRow | None:
        """The transaction's write lock on batch `k` of `name`, taken before `lock` (see the module docstring):
        SQLite's database lock (BEGIN IMMEDIATE, unless this transaction has written already and so holds it),
        PostgreSQL's row lock on the batch. Returns the batch as of now (`plain`: a plain object, no ORM row)."""
        conn = s.connection()
        db, pg = raw(conn), conn.dialect.name != "sqlite"
        if not pg and not db.in_transaction:
            db.execute("BEGIN IMMEDIATE")
        if not plain:
            return s.get(BatchRow, (name, k), with_for_update=True, populate_existing=True)
        row = db.execute(f"SELECT {', '.join(_PLAIN)} FROM batches WHERE job = ? AND k = ?"
                         + (" FOR UPDATE" if pg else ""), (name, k)).fetchone()
        return None if row is None else SimpleNamespace(job=name, k=k, **dict(zip(_PLAIN, row)))  # type: ignore[return-value]

    def _items_left(self, s: Session, job: RolloutJob) -> int | None:
        """Rollouts the job may still open under quotas.itemsPerJob, counted over its whole life (None: no quota)."""
        quota = self.item_quota(job)
        return None if quota is None else max(0, quota - opened.items(raw(s.connection()), job.metadata.key))

    # ------------------------------------------------------------ requests

    def current(self, s: Session, job: str) -> BatchRow | None:
        return s.exec(select(BatchRow).where(BatchRow.job == job).order_by(BatchRow.k.desc())).first()

    def request(self, s: Session, job: RolloutJob, k: int | None, prompts: list[int] | None = None) -> BatchRow:
        name = job.metadata.key
        if prompts is not None:
            self._check_prompts(job, prompts)
        cur = self.current(s, name)
        want = (cur.k + 1 if cur and cur.state == BatchState.complete else (cur.k if cur else 1)) if k is None else k
        if cur is not None and want == cur.k:
            if prompts is not None and self.named_prompts(s, name, cur.k) != prompts:
                raise Conflict(f"batch {cur.k} of rolloutjobs \"{name}\" was requested with other prompts")
            return cur
        if cur is not None and want < cur.k:
            return s.get(BatchRow, (name, want)) or self._gone(name, want)
        if cur is not None and cur.state != BatchState.complete:
            raise Conflict(f"batch {cur.k} of rolloutjobs \"{name}\" is still running; batch {want} comes after it")
        expected = cur.k + 1 if cur else 1
        if want != expected:
            raise BadRequest(f"the next batch of rolloutjobs \"{name}\" is {expected}, not {want}")
        limit = job.spec.batches.count if job.spec.batches else None
        if limit is not None and want > limit:
            raise Conflict(f"rolloutjobs \"{name}\" serves {limit} batches; all are done")
        row = BatchRow(job=name, k=want, target=batch_target(job) if prompts is None else len(prompts),
                       created=self.items.clock())
        left = self._items_left(s, job)
        if left is not None and row.target * job.spec.samples_per_prompt > left:
            message = (f"batch {want} needs {row.target} groups × {job.spec.samples_per_prompt} samples; the job may "
                       f"open {left} more rollouts under its quota (quotas.itemsPerJob {self.item_quota(job)})")
            raise Forbidden(f'rolloutjobs "{name}": {message}', causes=[
                {"field": "quotas.itemsPerJob", "reason": "FieldValueForbidden", "message": message}])
        s.add(row)
        if prompts is not None:
            s.add(BatchPromptsRow(job=name, k=want, prompts=json.dumps(prompts)))
        else:  # groups carried over from the previous batch are already running for this one
            row.opened_groups = len(s.exec(select(GroupRow.id).where(GroupRow.job == name, GroupRow.batch == want)).all())
        s.flush()
        self.fill(s, job, row)
        return row

    def _gone(self, name: str, k: int) -> BatchRow:
        raise NotFound(f"batch {k} of rolloutjobs \"{name}\" does not exist")

    def _check_prompts(self, job: RolloutJob, prompts: list[int]) -> None:
        name = job.metadata.key
        if job.spec.dapo.enabled:
            raise BadRequest(f"rolloutjobs \"{name}\" uses DAPO, which picks its own prompts; "
                             "name prompts only with spec.batches")
        if carry_over(job):
            raise BadRequest(f"rolloutjobs \"{name}\" carries groups over; name prompts only without carryOver")
        n = self.prompts(job)
        bad = [p for p in prompts if not 0 <= p < n]
        if not prompts or bad:
            raise BadRequest(f"prompts must be a non-empty list of dataset indices 0…{n - 1} of rolloutjobs "
                             f"\"{name}\"" + (f"; out of range: {bad[:10]}" if bad else ""))

    def named_prompts(self, s: Session, name: str, k: int) -> list[int] | None:
        row = raw(s.connection()).execute("SELECT prompts FROM batch_prompts WHERE job = ? AND k = ?", (name, k)).fetchone()
        return None if row is None else json.loads(row[0])

    # ------------------------------------------------------------ opening groups

    def fill(self, s: Session, job: RolloutJob, batch: BatchRow, wake: bool = True) -> int:
        """Open groups towards the batch's need (DAPO: up to maxInFlightGroups; named prompts: each once), at most
        CHUNK_ITEMS rollouts per call and never past quotas.itemsPerJob: how many groups it opened (called again while
        more than 0, a step at a time). `wake`: wake the job's leases (on the loop; a worker leaves it to the loop)."""
        self.hold(s, batch.job, batch.k)
        with self.lock:
            return self._fill(s, job, batch, wake)

    def fill_step(self, s: Session, job: RolloutJob, k: int) -> int:
        """`fill` of batch `k` in a worker thread (`Scheduler.fill_batch`, which wakes the leases), without ORM rows."""
        batch = self.hold(s, job.metadata.key, k, plain=True)
        with self.lock:
            return 0 if batch is None else self._fill(s, job, batch, False)

    def _fill(self, s: Session, job: RolloutJob, batch: BatchRow, wake: bool) -> int:
        """Reads and writes through `dialects.raw` (either database): the ORM's Python work was most of a step's."""
        if batch.state != BatchState.running:
            return 0
        s.flush()  # the caller's pending writes (a group just settled) count below
        db = raw(s.connection())
        step = max(1, CHUNK_ITEMS // job.spec.samples_per_prompt)
        left = self._items_left(s, job)
        if left is not None:
            step = min(step, left // job.spec.samples_per_prompt)
        named = self.named_prompts(s, batch.job, batch.k)
        if named is not None:  # a batch of named prompts opens each group once and replaces none
            chunk = named[batch.opened_groups:batch.opened_groups + step]
            if chunk:
                self._open(db, job, batch, chunk, wake)
            return len(chunk)
        name = job.metadata.key
        running = db.execute("SELECT count(*) FROM groups WHERE job = ? AND batch = ? AND state = ?",
                             (name, batch.k, GroupState.running)).fetchone()[0]
        cap = max_in_flight(job) - running
        if not job.spec.dapo.enabled:
            cap = min(cap, batch.target - batch.counted - running)
        cap = min(cap, step)
        if cap > 0 and self.gate is not None:
            cap = self.gate(s, job, cap)
        if cap <= 0:
            return 0
        prompts_in_dataset = self.prompts(job)
        if prompts_in_dataset == 0:
            return 0
        first = (db.execute("SELECT next_prompt FROM cursors WHERE job = ?", (name,)).fetchone() or (0,))[0]
        db.execute("INSERT INTO cursors (job, next_prompt) VALUES (?, ?) "
                   "ON CONFLICT (job) DO UPDATE SET next_prompt = excluded.next_prompt", (name, first + cap))
        self._open(db, job, batch, [(first + i) % prompts_in_dataset for i in range(cap)], wake)
        return cap

    def _open(self, db: Any, job: RolloutJob, batch: BatchRow, prompts: list[int], wake: bool) -> None:
        """The groups in one INSERT, their items in one INSERT … SELECT (`Items.add_groups_items`): no row objects."""
        name, now = job.metadata.key, self.items.clock()
        values = ", ".join(["(?, ?, ?, ?, '[]', ?)"] * len(prompts))
        params = [v for p in prompts for v in (name, batch.k, p, GroupState.running, now)]
        ids = [r[0] for r in db.execute("INSERT INTO groups (job, batch, prompt, state, rewards, opened) "
                                        f"VALUES {values} RETURNING id", params).fetchall()]
        self.items.add_groups_items(db, ids, job.spec.samples_per_prompt, now)
        n = len(prompts)
        opened.add(db, name, n * job.spec.samples_per_prompt)
        db.execute("UPDATE batches SET opened_groups = opened_groups + ? WHERE job = ? AND k = ?", (n, name, batch.k))
        # an ORM row's copy as written (its flush writes nothing more); `fill_step`'s plain object as is
        (set_committed_value if isinstance(batch, BatchRow) else setattr)(batch, "opened_groups", batch.opened_groups + n)
        if wake:
            self.items.wake(name)

    # ------------------------------------------------------------ settling groups

    def group_settled(self, s: Session, job: RolloutJob, group_id: int) -> None:
        """Called when an item of the group became final; settles the group once all are."""
        group = s.get(GroupRow, group_id)
        if group is None or group.state != GroupState.running:
            return
        self.hold(s, group.job, group.batch)
        with self.lock:
            self._settled(s, job, group)

    def _settled(self, s: Session, job: RolloutJob, group: GroupRow) -> None:
        group_id = group.id
        items = s.exec(select(ItemRow).where(ItemRow.group_id == group_id)).all()
        if any(i.state in LIVE for i in items):
            return
        rows = s.exec(select(TrajectoryRow.reward, TrajectoryRow.failure).where(TrajectoryRow.group_id == group_id)).all()
        rewards = [r for r, f in rows if r is not None and f != "infra"]
        group.settled = self.items.clock()
        group.rewards = json.dumps(rewards)
        if len(rewards) < len(items):
            group.state = GroupState.incomplete
        elif informative(job, rewards):
            group.state = GroupState.counted
        else:
            group.state = GroupState.uninformative
        s.add(group)
        batch = s.get(BatchRow, (group.job, group.batch))
        if batch is None or batch.state != BatchState.running:
            return
        if group.state == GroupState.counted:
            batch.counted += 1
        if group.state == GroupState.incomplete:
            lost = len(s.exec(select(GroupRow.id).where(GroupRow.job == group.job, GroupRow.batch == batch.k,
                                                        GroupRow.state == GroupState.incomplete)).all())
            if lost > incomplete_limit(batch.target):
                # infrastructure keeps failing: replacing groups forever would hide it from the trainer
                batch.state, batch.completed = BatchState.failed, self.items.clock()
                for g in s.exec(select(GroupRow).where(GroupRow.job == group.job, GroupRow.batch == batch.k,
                                                       GroupRow.state == GroupState.running)):
                    self._cancel_group(s, g)
                s.add(batch)
                return
        named = self.named_prompts(s, group.job, batch.k) is not None
        if batch.counted >= batch.target or (named and batch.opened_groups >= batch.target
                                             and self._all_settled(s, group.job, batch.k)):
            self._complete(s, job, batch)
        else:
            self.fill(s, job, batch)  # replenish at once
        s.add(batch)

    def _all_settled(self, s: Session, name: str, k: int) -> bool:
        return s.exec(select(GroupRow.id).where(GroupRow.job == name, GroupRow.batch == k,
                                                GroupRow.state == GroupState.running)).first() is None

    def _complete(self, s: Session, job: RolloutJob, batch: BatchRow) -> None:
        name = job.metadata.key
        batch.state, batch.completed = BatchState.complete, self.items.clock()
        surplus = s.exec(select(GroupRow).where(GroupRow.job == name, GroupRow.batch == batch.k,
                                                GroupRow.state == GroupState.running)).all()
        if carry_over(job):
            for g in surplus:
                g.batch = batch.k + 1
                s.add(g)
            return
        cancelled = never = 0
        for g in surplus:
            c, n = self._cancel_group(s, g)
            cancelled, never = cancelled + c, never + n
        done_tokens = [json.loads(d).get("lossMask", []) for d in s.exec(
            select(TrajectoryRow.data).join(GroupRow, TrajectoryRow.group_id == GroupRow.id)
            .where(GroupRow.job == name, GroupRow.batch == batch.k).limit(64)).all()] if cancelled else []
        per = statistics.fmean(sum(m) for m in done_tokens) if done_tokens else 0.0
        batch.cancelled_rollouts, batch.never_started = cancelled, never
        batch.saved_tokens = int(per * cancelled)

    def cancel_group(self, s: Session, g: GroupRow) -> tuple[int, int]:
        return self._cancel_group(s, g)

    def _cancel_group(self, s: Session, g: GroupRow) -> tuple[int, int]:
        """Cancel a running group's live rollouts (daemons learn it at their next beat)."""
        cancelled = never = 0
        g.state, g.settled = GroupState.cancelled, self.items.clock()
        s.add(g)
        for item in s.exec(select(ItemRow).where(ItemRow.group_id == g.id, ItemRow.state.in_(LIVE))):
            cancelled += 1
            held = self.items.leases.get(item.attempt_id) if item.attempt_id else None  # stages live in memory
            if item.state == ItemState.queued or (held.stage if held else item.stage) in ("leased", "init"):
                never += 1
            self.items.cancel_item(item)
            s.add(item)
        return cancelled, never

    def failure(self, s: Session, name: str) -> str | None:
        bad = s.exec(select(BatchRow).where(BatchRow.job == name, BatchRow.state == BatchState.failed)).first()
        if bad is None:
            return None
        return (f"batch {bad.k}: more than {incomplete_limit(bad.target)} groups lost samples to infrastructure "
                "failures (see the trajectories' failure reasons); the batch cannot be filled")

    # ------------------------------------------------------------ reading

    def snapshot(self, s: Session, name: str, k: int, include_all: bool = False) -> dict[str, Any]:
        batch = s.get(BatchRow, (name, k))
        if batch is None:
            raise NotFound(f"batch {k} of rolloutjobs \"{name}\" does not exist; request it first")
        q = select(GroupRow).where(GroupRow.job == name, GroupRow.batch == k)
        if not include_all:
            q = q.where(GroupRow.state == GroupState.counted)
        groups = []
        for g in s.exec(q.order_by(GroupRow.id)).all():
            samples = [json.loads(d) for d in s.exec(
                select(TrajectoryRow.data).where(TrajectoryRow.group_id == g.id).order_by(TrajectoryRow.sample)).all()]
            groups.append({"group": g.id, "prompt": g.prompt, "state": g.state, "rewards": json.loads(g.rewards),
                           "samples": samples})
        versions = sorted({str(t.get("policyVersion")) for g in groups for t in g["samples"]})
        return {
            "batch": k, "state": batch.state, "target": batch.target, "counted": batch.counted,
            "prompts": self.named_prompts(s, name, k),
            "openedGroups": batch.opened_groups, "groups": groups,
            "cancelledRollouts": batch.cancelled_rollouts, "neverStarted": batch.never_started,
            "savedTokensEstimate": batch.saved_tokens,
            "secondsToFill": (batch.completed - batch.created) if batch.completed else None,
            "policyVersions": versions,
        }

    def status(self, s: Session, name: str) -> dict[str, Any] | None:
        cur = self.current(s, name)
        if cur is None:
            return {"current": 0, "state": "idle", "counted": 0, "target": 0, "completed": 0}
        done = len(s.exec(select(BatchRow.k).where(BatchRow.job == name, BatchRow.state == BatchState.complete)).all())
        return {"current": cur.k, "state": cur.state, "counted": cur.counted, "target": cur.target, "completed": done}

    def finished(self, s: Session, job: RolloutJob) -> bool:
        limit = job.spec.batches.count if job.spec.batches else None
        if limit is None:
            return False
        row = s.get(BatchRow, (job.metadata.key, limit))
        return row is not None and row.state == BatchState.complete
