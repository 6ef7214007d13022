"""The Slurm executor: a RolloutJob's node daemons as Slurm allocations, watched and healed.

Called by the reconcile (`ensure` / `observe` / `release`, the `Executor` of `executors/base.py`) on every
pass over a job with `executor.kind: slurm`, level-triggered. Next steps: `script.py` builds what sbatch
submits, `cli.py` runs Slurm's commands, `retire.py` takes allocations away (shrink, release), `state.py`
is what survives a restart. What it does for each event (grow, shrink, loss, restart, refusal) is the
table in examples/slurm/README.md. Test seams: `run(argv, env, input) -> (rc, stdout, stderr)`, `clock`.
"""
from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
from pathlib import Path
from typing import Callable

from rolloutd.crds.kit.aiokit import backoff_delay
from rolloutd.crds import nodeenv
from rolloutd.crds.rolloutjob import RolloutJob

from ..logs import NoLogs, files_stream, job_files, log_stem
from ..base import Credentials, ExecutorError, NodeRoster, NodeState, Site, StateFile, crash_count, crash_delay, \
    daemon_env
from .cli import PERMANENT_PENDING, Runner, SlurmCli, SlurmJob, expand_hostlist, last_lines, read_tail, refusal, \
    unavailable
from .retire import Retirer
from .script import batch_script, sbatch_argv
from .state import Allocation, JobRecord, dump_records, load_records

log = logging.getLogger("rolloutd.executor.slurm")

JUST_SUBMITTED_SECONDS = 10.0  # an allocation squeue does not list yet is not lost before this


class SlurmExecutor:
    kind = "slurm"
    shares_files = False  # its daemons run elsewhere: they do not see this controller's files
    def __init__(self, controller_url: str, credentials: Credentials, data_dir: Path, *,
                 python: str = sys.executable, grace_seconds: float | None = None, max_failures: int = 5,
                 stable_seconds: float = 60.0, finish_grace: float = 15.0, max_backoff: float = 60.0,
                 poll_interval: float = 1.0, extra_env: dict[str, str] | None = None, nodes: NodeRoster | None = None,
                 event: Callable[[str, str, str, str], None] | None = None, run: Runner | None = None,
                 clock: Callable[[], float] = time.time, drain_seconds: float = nodeenv.DEFAULT_DRAIN_SECONDS):
        self.controller_url, self.credentials, self.data_dir = controller_url, credentials, data_dir
        self.log_dir = data_dir / "logs"
        self.file = StateFile(data_dir / "slurm-executor.json")
        self.python = python
        # `drain_seconds`: the daemons' own grace ($ROLLOUTD_DRAIN_SECONDS, which they inherit through sbatch)
        self.grace = grace_seconds if grace_seconds is not None else drain_seconds + 15.0
        self.max_failures, self.finish_grace, self.stable_seconds = max_failures, finish_grace, stable_seconds
        self.max_backoff, self.poll_interval = max_backoff, poll_interval
        self.extra_env = extra_env or {}
        self._event = event
        self.clock = clock
        self.cli = SlurmCli(run)
        self.state = load_records(self.file.load())
        self.retirer = Retirer(self.cli, self.state, clock=clock, grace=self.grace, registry=nodes,
                               emit=self._emit)
        self._adopted = False
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.submitted = 0  # sbatch calls by this process (tests, metrics)

    @classmethod
    def from_site(cls, site: Site) -> SlurmExecutor:
        """Daemons elsewhere (the controller's advertised address), drained one by one through the node roster."""
        return cls(site.remote_url(), site.credentials, site.data_dir, nodes=site.nodes,
                   drain_seconds=site.settings.drain_seconds, event=site.event)

    # ------------------------------------------------------------ Executor

    async def ensure(self, job: RolloutJob, nodes: int) -> None:
        """Losses are counted (and replaced after the crash back-off), hopeless pending ones fail the job,
        a surplus is retired, a shortfall gets one more allocation for the difference."""
        async with self._lock:
            try:
                snap = await self._snapshot()
                await self.retirer.sweep(snap)
                rec = self._record(job)
                await self._account(job, rec, snap)
                await self._permanent_pending(rec, snap)
                if rec.size > nodes:
                    await self.retirer.shrink(job.metadata.key, rec, snap, rec.size - nodes)
                    if self.state.dirty:
                        await self.retirer.sweep(snap)
                        self._follow_up()
                await self.retirer.finish_partial_shrinks(job.metadata.key, rec, snap)
                if rec.size < nodes and self.clock() >= rec.next_submit:
                    await self._submit(job, rec, nodes - rec.size)
            finally:
                self._save_if_dirty()

    async def observe(self, job: RolloutJob) -> list[NodeState]:
        async with self._lock:
            snap = await self._snapshot()
            rec = self.state.get(job.metadata.key)
            if rec is None:
                return []
            out: list[NodeState] = []
            for aid, alloc in rec.allocs.items():
                out += _node_states(aid, alloc, snap.get(aid))
            if not out and rec.last_error:
                wait = max(rec.next_submit - self.clock(), 0)
                why = rec.last_error + (f"; resubmitting in {wait:.0f}s" if wait >= 1 else "; resubmitting")
                out.append(NodeState(f"{job.metadata.key}-slurm", "lost", why))
            return out

    async def release(self, job: RolloutJob) -> None:
        """Every allocation is retired (the follow-up sweep escalates to scancel); cheap once done. The job's
        node credential is revoked first: a daemon still draining can no longer act for it."""
        name = job.metadata.key
        self.credentials.revoke(job)
        if name not in self.state:  # cheap: called on every pass over a finished job
            if self._adopted:
                return
            try:
                async with self._lock:
                    await self._snapshot()  # a restarted controller first adopts what runs
            except ExecutorError as e:
                log.warning("releasing %s: %s", name, e)
                return
            if name not in self.state:
                return
        async with self._lock:
            try:
                snap = await self._snapshot()
                rec = self.state.get(name)
                if rec is None:
                    return
                # a finished job's daemons leave by themselves (the controller tells them the job is
                # done): they get `finish_grace` before SIGTERM; a deleted job's get it at once
                delay = 0.0 if job.metadata.deletion_timestamp is not None else self.finish_grace
                for aid in list(rec.allocs):
                    rec.retire(aid, self.clock(), delay)
                rec.released = True
                self.state.dirty = True
                await self.retirer.sweep(snap)
            finally:
                self._save_if_dirty()
            if name in self.state:
                self._follow_up()

    async def shutdown(self) -> None:
        """Controller exit: allocations keep running (a restarted controller adopts them)."""
        for t in list(self._tasks):
            t.cancel()

    async def logs(self, job: RolloutJob, node: int | None, tail: int, follow: bool):
        """Each allocation's output file (`slurm-<job>-<id>.out`, where sbatch writes it), in which srun's --label
        puts the node's index before each daemon line: node K is the lines of every allocation's K-th node."""
        name = job.metadata.key
        found = job_files(self.log_dir, rf"slurm-{re.escape(log_stem(name))}-(\d+)\.out")
        if not found:
            raise NoLogs(f"rolloutjob {name} has no Slurm output file yet")
        keep = None if node is None else re.compile(rf"\s*{node}: ").match
        return files_stream(((f"slurm-{k}", p) for k, p in sorted(found.items())), tail, follow,
                            keep and (lambda line: keep(line) is not None))

    # ------------------------------------------------------------ record

    def _record(self, job: RolloutJob) -> JobRecord:
        name, uid = job.metadata.key, job.metadata.uid or ""
        rec = self.state.get(name)
        if rec is None or rec.uid != uid:
            new = self.state[name] = JobRecord(uid=uid)
            if rec is not None:  # re-created under the same name: the old one's allocations are retired
                new.retired = rec.retired
                for aid in list(rec.allocs):
                    new.retire(aid, self.clock())
            self.state.dirty = True
            return new
        rec.released = False
        return rec

    def _save_if_dirty(self) -> None:
        if self.state.dirty:
            self.state.dirty = False
            self.file.save(dump_records(self.state))

    def _emit(self, job: str, reason: str, message: str, type_: str = "Normal") -> None:
        log.log(logging.WARNING if type_ == "Warning" else logging.INFO, "%s: %s: %s", job, reason, message)
        if self._event is not None:
            try:
                self._event(job, reason, message, type_)
            except Exception:  # noqa: BLE001 - an event is best effort
                log.exception("recording event failed")

    # ------------------------------------------------------------ Slurm's view

    async def _snapshot(self) -> dict[str, SlurmJob]:
        """Every job of this user that Slurm still knows (cached for `poll_interval`)."""
        snap = await self.cli.jobs(self.poll_interval)
        if not self._adopted:
            self._adopt(snap)
        return snap

    def _adopt(self, snap: dict[str, SlurmJob]) -> None:
        """Live allocations tagged by this service that the state file does not know (a controller
        that died between sbatch and saving) become the jobs' own again."""
        self._adopted = True
        known = {a for rec in self.state.values() for a in (*rec.allocs, *rec.retired)}
        for sj in snap.values():
            tag = sj.tag()
            if not sj.live or not tag.get("uid") or not tag.get("job") or sj.id in known:
                continue
            rec = self.state.setdefault(tag["job"], JobRecord(uid=tag["uid"]))
            if rec.uid != tag["uid"]:
                continue  # another incarnation of that name: left alone (release() of it retires it)
            rec.allocs[sj.id] = Allocation(nodes=sj.nodes, submitted=self.clock())
            self.state.dirty = True
            self._emit(tag["job"], "SlurmAdopted", f"adopted Slurm job {sj.id} ({sj.state}, {sj.nodes} node(s))")
        self._save_if_dirty()

    async def _why_ended(self, sj: SlurmJob | None, alloc_id: str) -> str:
        state = sj.state if sj is not None else "GONE"
        info = await self.cli.show_job(alloc_id)
        if sj is None and info.get("JobState"):
            state = info["JobState"]
        msg = f"Slurm job {alloc_id} ended {state}"
        reason = info.get("Reason") or (sj.reason if sj else "")
        if reason and reason != "None":
            msg += f" (reason {reason})"
        if info.get("ExitCode") and info["ExitCode"] != "0:0":
            msg += f", exit code {info['ExitCode']}"
        if sj is None and not info:
            msg = f"Slurm job {alloc_id} is no longer known to Slurm"
        tail = last_lines(read_tail(info.get("StdOut", "")), 3)
        if tail and state not in ("CANCELLED", "COMPLETED"):
            msg += f"; output: {tail}"
        return msg

    # ------------------------------------------------------------ steps

    async def _account(self, job: RolloutJob, rec: JobRecord, snap: dict[str, SlurmJob]) -> None:
        """Allocations that ended without being retired are losses: counted, their daemons forgotten."""
        name = job.metadata.key
        for aid, alloc in list(rec.allocs.items()):
            sj = snap.get(aid)
            if sj is not None and sj.live:
                if sj.running and alloc.started is None:
                    alloc.started, alloc.nodelist = self.clock(), sj.nodelist
                    self.state.dirty = True
                    self._emit(name, "SlurmRunning", f"Slurm job {aid} is running on {sj.nodelist}")
                elif sj.running and rec.failures and self.clock() - alloc.started >= self.stable_seconds:
                    rec.failures, rec.last_error = 0, ""  # healthy again: the crash-loop count starts anew
                    self.state.dirty = True
                continue
            if sj is None and self.clock() - alloc.submitted < JUST_SUBMITTED_SECONDS:
                continue  # just submitted: not in this snapshot yet
            del rec.allocs[aid]
            self.state.dirty = True
            msg = await self._why_ended(sj, aid)
            rec.failures = crash_count(rec.failures, alloc.started, self.clock(), self.stable_seconds)
            rec.last_error = msg
            backoff = crash_delay(rec.failures, self.max_backoff)
            rec.next_submit = self.clock() + backoff
            if rec.failures > self.max_failures:
                self._emit(name, "SlurmAllocationLost", msg, "Warning")
                raise ExecutorError(f"{rec.failures} Slurm allocations in a row ended within "
                                    f"{self.stable_seconds:.0f}s of starting; last: {msg}",
                                    reason="SlurmAllocationFailed", permanent=True)
            self._emit(name, "SlurmAllocationLost", f"{msg}; replacing it"
                       + (f" in {backoff:.0f}s" if backoff else ""), "Warning")

    async def _permanent_pending(self, rec: JobRecord, snap: dict[str, SlurmJob]) -> None:
        for aid in list(rec.allocs):
            sj = snap.get(aid)
            if sj is not None and sj.state == "PENDING" and sj.reason in PERMANENT_PENDING:
                rec.retire(aid, self.clock())
                self.state.dirty = True
                await self.retirer.sweep(snap)
                self._save_if_dirty()
                raise ExecutorError(f"Slurm job {aid} can never start: {sj.reason} ({PERMANENT_PENDING[sj.reason]})",
                                    reason=sj.reason, permanent=True)

    async def _submit(self, job: RolloutJob, rec: JobRecord, count: int) -> None:
        """sbatch with the daemon contract in its environment (`--export=ALL` hands it to srun's tasks):
        the job's node credential never appears on a command line or in Slurm's job record."""
        name, uid = job.metadata.key, job.metadata.uid or ""
        spec = job.spec.executor.slurm
        self.log_dir.mkdir(parents=True, exist_ok=True)
        argv = sbatch_argv(name, uid, count, spec, data_dir=self.data_dir, log_dir=self.log_dir, grace=self.grace)
        script = batch_script(name, uid, spec.setup, self.python)
        env = daemon_env(self.cli.env(), self.extra_env, self.controller_url, name,
                         self.credentials.mint(job))
        aid, rc, text = await self.cli.sbatch(argv, script, env)
        self.cli.invalidate()
        if aid is not None:
            self.submitted += 1
            rec.submits += 1
            rec.allocs[aid] = Allocation(nodes=count, submitted=self.clock())
            self.state.dirty = True
            self._save_if_dirty()
            self._emit(name, "SlurmSubmitted", f"submitted Slurm job {aid} for {count} node(s)")
            return
        if rc == 127:
            raise unavailable(text)
        reason = refusal(text)
        if reason is not None:
            raise ExecutorError(f"sbatch refused the allocation: {text}", reason=reason, permanent=True)
        rec.failures += 1
        rec.last_error = f"sbatch failed: {text}"
        backoff = backoff_delay(rec.failures, initial=2.0, maximum=self.max_backoff)
        rec.next_submit = self.clock() + backoff
        self.state.dirty = True
        self._save_if_dirty()
        if rec.failures > self.max_failures:
            raise ExecutorError(f"sbatch failed {rec.failures} times; last: {text}", reason="SlurmSubmitFailed",
                                permanent=True)
        raise ExecutorError(f"sbatch failed (retrying in {backoff:.0f}s): {text}", reason="SlurmSubmitFailed")

    def _follow_up(self) -> None:
        """Keep sweeping retired allocations until Slurm has let them go (also for deleted jobs)."""
        if any(not t.done() for t in self._tasks):
            return

        async def loop() -> None:
            while any(rec.retired for rec in self.state.values()):
                await asyncio.sleep(min(max(self.poll_interval, 0.5), 2.0))
                try:
                    async with self._lock:
                        await self.retirer.sweep(await self._snapshot())
                        self._save_if_dirty()
                except ExecutorError as e:
                    log.warning("%s", e)
                except Exception:  # noqa: BLE001 - never let the follow-up die silently
                    log.exception("sweeping retired Slurm allocations failed")

        try:
            task = asyncio.get_running_loop().create_task(loop(), name="slurm-release")
        except RuntimeError:
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _node_states(aid: str, alloc: Allocation, sj: SlurmJob | None) -> list[NodeState]:
    """What one allocation contributes to `observe`: one reason per allocation (the reconcile joins
    them when no daemon registered)."""
    if sj is None:
        return [NodeState(f"slurm-{aid}", "pending", f"Slurm job {aid} submitted")]
    if sj.running:
        names = expand_hostlist(sj.nodelist) or [f"slurm-{aid}"]
        return [NodeState(n, "finished" if n in alloc.drained else "running",
                          f"Slurm job {aid} RUNNING on {sj.nodelist}; daemons starting" if i == 0 else "")
                for i, n in enumerate(names)]
    if sj.live:
        why = f"Slurm job {aid} {sj.state} (reason {sj.reason})" if sj.reason not in ("", "None") \
            else f"Slurm job {aid} {sj.state}"
        return [NodeState(f"slurm-{aid}-{i}", "pending", why if i == 0 else "") for i in range(max(alloc.nodes, 1))]
    return []
