"""Taking nodes away from a job on Slurm: whole allocations are retired (SIGTERM so the daemons drain,
scancel after the grace period); part of a running one drains its daemons, then gives the nodes back.

Called by `executor.py` (shrinks, release, the follow-up sweep); runs its commands through `cli.py`
and records progress in the job's `JobRecord` (`state.py`), so escalation survives a restart.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

from ..base import NodeRoster
from .cli import SlurmCli, SlurmJob, expand_hostlist
from .state import Allocation, JobRecord, Records

log = logging.getLogger("rolloutd.executor.slurm")

Emit = Callable[..., None]          # (job, reason, message[, type]) → a Kubernetes-style event
RESCANCEL_SECONDS = 30.0            # a retired allocation Slurm still lists gets scancel again this often
FORGET_UNSEEN_SECONDS = 10.0        # a retired allocation squeue never showed is forgotten after this


class Retirer:
    def __init__(self, cli: SlurmCli, records: Records, *, clock: Callable[[], float], grace: float,
                 registry: NodeRoster | None, emit: Emit, exit_settle: float = 5.0) -> None:
        self.cli = cli
        self.records = records
        self.clock = clock
        self.grace = grace
        self.registry = registry
        self.emit = emit
        self.exit_settle = exit_settle  # after a drained daemon deregisters, before its node goes back

    async def sweep(self, snap: dict[str, SlurmJob]) -> None:
        """Retired allocations: SIGTERM when running (daemons drain), scancel when pending or past the
        grace period; forgotten once Slurm reports them ended. Released jobs with nothing left go."""
        now = self.clock()
        for name, rec in list(self.records.items()):
            for aid, r in list(rec.retired.items()):
                sj = snap.get(aid)
                if sj is None or not sj.live:
                    if sj is not None or now - r.at > FORGET_UNSEEN_SECONDS:
                        del rec.retired[aid]
                        self.records.dirty = True
                    continue
                if sj.running and not r.sigterm_sent:
                    if now < r.sigterm_due:
                        continue
                    await self.cli.scancel(aid, term=True)
                    r.sigterm_sent = True
                    self.records.dirty = True
                elif (not sj.running or now - r.sigterm_due > self.grace) \
                        and (not r.scancel_sent or now - r.scancel_at > RESCANCEL_SECONDS):
                    await self.cli.scancel(aid)
                    r.scancel_sent, r.scancel_at = True, now
                    self.records.dirty = True
                    self.cli.invalidate()
            if not rec.retired and not rec.allocs and rec.released:
                del self.records[name]
                self.records.dirty = True

    async def shrink(self, name: str, rec: JobRecord, snap: dict[str, SlurmJob], surplus: int) -> bool:
        """Take `surplus` nodes away, newest allocation first; True when anything changed."""
        changed = False
        for aid in sorted(rec.allocs, key=lambda a: int(a) if a.isdigit() else 0, reverse=True):
            if surplus <= 0:
                break
            alloc = rec.allocs[aid]
            size = alloc.size
            sj = snap.get(aid)
            if size <= surplus or sj is None or not sj.running:
                # the whole allocation goes (a pending one is replaced by a smaller one if need be)
                rec.retire(aid, self.clock())
                surplus -= size
                changed = True
                self.emit(name, "SlurmScaleDown", f"retiring Slurm job {aid} ({size} node(s))")
                continue
            # part of a running allocation: drain the daemons on its last nodes
            names = [n for n in expand_hostlist(sj.nodelist) if n not in alloc.drained]
            victims = names[len(names) - surplus:] if len(names) > 1 else []
            if not victims:
                continue
            alloc.drained.extend(victims)
            alloc.drain_at = self.clock()
            self._drain_daemons(name, aid, victims)
            surplus -= len(victims)
            changed = True
            self.emit(name, "SlurmScaleDown", f"draining the daemons on {', '.join(victims)} of Slurm job {aid}")
        self.records.dirty |= changed
        return changed

    async def finish_partial_shrinks(self, name: str, rec: JobRecord, snap: dict[str, SlurmJob]) -> None:
        """Nodes whose daemons have drained (or the grace ran out) go back to Slurm."""
        for aid, alloc in rec.allocs.items():
            sj = snap.get(aid)
            if alloc.drained and sj is not None and sj.running:
                await self._give_back(name, aid, alloc, sj)

    async def _give_back(self, name: str, aid: str, alloc: Allocation, sj: SlurmJob) -> None:
        still = self._daemons_on(name, aid, alloc.drained)
        if still and self.clock() - alloc.drain_at < self.grace:
            self._drain_daemons(name, aid, alloc.drained)  # one that registered since
            return
        if not still:  # deregistered: give the processes a moment to exit before Slurm kills them
            if alloc.left_at is None:
                alloc.left_at = self.clock()
            self.records.dirty = True
            if self.clock() - alloc.left_at < self.exit_settle:
                return
        keep = [n for n in expand_hostlist(sj.nodelist) if n not in alloc.drained]
        if not keep:
            return
        error = await self.cli.keep_nodes(aid, keep)
        self.cli.invalidate()
        if error is not None:
            log.warning("could not give back nodes %s of Slurm job %s: %s", alloc.drained, aid, error)
            alloc.drain_at = self.clock()  # try again after another grace period
        else:
            self.emit(name, "SlurmScaleDown", f"gave nodes {', '.join(alloc.drained)} of Slurm job {aid} "
                      f"back to Slurm")
            alloc.nodes, alloc.drained, alloc.left_at = len(keep), [], None
        self.records.dirty = True

    # ------------------------------------------------------------ the scheduler's node registry

    def _nodes(self, job: str) -> list[Any]:
        if self.registry is None:
            return []
        try:
            return list(self.registry.nodes(job))
        except Exception:  # noqa: BLE001
            log.exception("listing the nodes of %s failed", job)
            return []

    def _drain_daemons(self, job: str, aid: str, hosts: list[str]) -> None:
        ids = [n.id for n in self._nodes(job) if str(getattr(n, "slurm_job_id", "")) == aid and n.name in hosts]
        if ids and self.registry is not None:
            self.registry.drain(job, ids)

    def _daemons_on(self, job: str, aid: str, hosts: list[str]) -> list[str]:
        return [n.id for n in self._nodes(job)
                if str(getattr(n, "slurm_job_id", "")) == aid and n.name in hosts and n.state != "gone"]
