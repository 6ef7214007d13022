"""The Slurm executor: a RolloutJob's node daemons as Slurm allocations, watched and healed.

Called by the reconciler (`ensure` / `observe` / `release`, the `Executor` protocol) on every pass
over a job with `executor.kind: slurm`. It drives Slurm through its CLI (`sbatch --parsable`,
`squeue`, `scontrol`, `scancel`; pyslurm cannot be built against Debian's 22.05), honouring
`SLURM_CONF` and the rest of the controller's environment.

Desired vs observed, level-triggered:

- **Allocations.** A job owns one or more Slurm jobs ("allocations"); the first one asks for
  `spec.executor.nodes` nodes, and its batch script runs `srun --ntasks-per-node=1` → one
  `rolloutd node` per node (each registers with SLURM_JOB_ID / SLURM_NODEID / SLURMD_NODENAME).
  Every allocation carries `rolloutd uid=<job uid> job=<name>` in its Slurm comment.
- **Grow**: a running job whose `nodes` goes up gets one more allocation for the difference; the
  running daemons are not touched. **Shrink**: whole allocations are retired newest first (SIGTERM
  to their daemons: they hand back unstarted work, finish what is in flight, exit 0); when only
  part of an allocation must go, the daemons on its last nodes are drained through the scheduler
  and, once they have left, those nodes are given back to Slurm (`scontrol update JobId=…
  NodeList=<kept>`; the step goes on on the others).
- **Loss**: an allocation that ends without being retired (FAILED, TIMEOUT, NODE_FAIL, PREEMPTED,
  OUT_OF_MEMORY, CANCELLED by someone else, BOOT_FAIL, its record gone) is replaced by a new one,
  at once the first time and with exponential back-off when allocations keep dying young; after
  `max_failures` quick deaths in a row the job fails with the last one's message. Its daemons'
  leases go back to the queue when they are not extended (`pipeline.leaseSeconds`): a daemon
  still draining in Slurm's KillWait may deliver what it finishes, and an expired attempt's late
  result is dropped by the scheduler, so every rollout arrives exactly once.
- **Adoption**: the allocations of each job are recorded in `slurm-executor.json` in the data dir,
  and Slurm itself is asked too (`squeue` by comment), so a restarted controller — even one that
  died between `sbatch` and writing that file — adopts what runs and never submits a duplicate.
- **Release** (deletion, completion): `scancel --signal=TERM` to running allocations (daemons
  drain), `scancel` for pending ones, and a plain `scancel` after the grace period for whatever
  is still there; escalation survives a controller restart.
- **Refusals**: sbatch errors that no retry will fix (invalid partition, account, QOS, time limit,
  constraint, node count, options) and pending reasons that never resolve (InvalidAccount,
  InvalidQOS, BadConstraints, PartitionTimeLimit, …) fail the job with Slurm's own words; other
  errors (controller unreachable) are retried with back-off and shown as a condition. A Slurm
  that cannot be queried never counts as a lost allocation.

The join token never appears on a command line or in Slurm's job record: sbatch runs with a
sanitised copy of the controller's environment (its API token and any SLURM_* of its own removed)
plus ROLLOUTD_CONTROLLER / ROLLOUTD_JOB / ROLLOUTD_JOIN_TOKEN, and `--export=ALL` hands it to the
batch script and from there to srun's tasks (it lives in the processes' environments, readable
by the job's user and root only). The script itself comes in on sbatch's stdin.

Test seams: `run(argv, env, input) -> (rc, stdout, stderr)` (a fake Slurm CLI), `clock`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from rolloutd.crds.rolloutjob import RolloutJob

from ..reconciler import ExecutorError, NodeState

log = logging.getLogger("rolloutd.executor.slurm")

LIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
        "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}
RUNNING = {"RUNNING", "COMPLETING", "CONFIGURING", "SIGNALING", "STAGE_OUT", "RESIZING"}

# Pending reasons that no amount of waiting fixes: the job fails with Slurm's reason.
PERMANENT_PENDING = {
    "InvalidAccount": "the account is invalid",
    "InvalidQOS": "the QOS is invalid",
    "AccountNotAllowed": "the account may not use this partition",
    "QOSNotAllowed": "the QOS may not use this partition",
    "BadConstraints": "no node can satisfy the constraints",
    "PartitionTimeLimit": "the time limit exceeds the partition's maximum",
    "PartitionConfig": "the request does not fit the partition's configuration",
}

# sbatch refusals that a retry will not fix → (condition reason, permanent)
SUBMIT_ERRORS: list[tuple[re.Pattern, str]] = [
    (re.compile(r"invalid partition", re.I), "InvalidPartition"),
    (re.compile(r"invalid account|account/partition combination", re.I), "InvalidAccount"),
    (re.compile(r"invalid qos", re.I), "InvalidQOS"),
    (re.compile(r"time limit|--time", re.I), "InvalidTimeLimit"),
    (re.compile(r"invalid feature|constraint", re.I), "InvalidConstraint"),
    (re.compile(r"node count specification|requested node configuration is not available|"
                r"more processors requested than permitted", re.I), "InvalidNodeCount"),
    (re.compile(r"unrecognized option|invalid option|unknown option|invalid argument|invalid .*specification|"
                r"usage:", re.I), "InvalidSbatchArguments"),
    (re.compile(r"access denied|user's group not permitted|not permitted to use", re.I), "AccessDenied"),
]

SCRIPT = """#!/bin/bash
# rolloutd node daemons for RolloutJob "{job}" (uid {uid}), written by the controller's slurm executor.
# One daemon per allocated node, started again if it crashes. The controller URL and the join token come in through the
# environment (sbatch --export=ALL), never on a command line.
set -e
{setup}
exec srun --ntasks-per-node=1 --kill-on-bad-exit=0 {python} -m rolloutd.controller.main node --restarts {restarts}
"""
RESTARTS = 5  # a daemon that crashes is started again on its node (agents/supervise.py), this often per 10 min

Runner = Callable[[list[str], dict[str, str], str | None], Awaitable[tuple[int, str, str]]]


async def run_cli(argv: list[str], env: dict[str, str], input_: str | None = None,
                  timeout: float = 60.0) -> tuple[int, str, str]:
    """Run one Slurm command; (returncode, stdout, stderr). A missing binary is rc 127."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, env=env, stdin=asyncio.subprocess.PIPE if input_ is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    except FileNotFoundError as e:
        return 127, "", f"{argv[0]}: {e.strerror}"
    try:
        out, err = await asyncio.wait_for(proc.communicate(input_.encode() if input_ is not None else None), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return 124, "", f"{argv[0]} timed out after {timeout:g}s"
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


def expand_hostlist(spec: str) -> list[str]:
    """Slurm hostlist → names: 'n[1-3,5],gpu01' → n1 n2 n3 n5 gpu01 (zero padding kept)."""
    names: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", spec.strip()):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            if part and part not in ("(null)", "None"):
                names.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if hi and lo.isdigit() and hi.isdigit():
                width = len(lo)
                names += [f"{prefix}{i:0{width}d}{suffix}" for i in range(int(lo), int(hi) + 1)]
            elif lo:
                names.append(f"{prefix}{lo}{suffix}")
    return names


@dataclass
class SlurmJob:
    """One row of `squeue -t all`."""
    id: str
    name: str
    state: str
    reason: str
    nodes: int
    nodelist: str
    comment: str

    @property
    def live(self) -> bool:
        return self.state in LIVE

    @property
    def running(self) -> bool:
        return self.state in RUNNING

    def tag(self) -> dict[str, str]:
        if not self.comment.startswith("rolloutd "):
            return {}
        return dict(kv.split("=", 1) for kv in self.comment.split()[1:] if "=" in kv)


SQUEUE_FORMAT = "%i|%j|%T|%r|%D|%N|%k"


def parse_squeue(text: str) -> dict[str, SlurmJob]:
    out: dict[str, SlurmJob] = {}
    for line in text.splitlines():
        parts = line.strip().split("|", 6)
        if len(parts) != 7 or not parts[0]:
            continue
        jid, name, state, reason, nodes, nodelist, comment = parts
        state = state.strip().split()[0].rstrip("+") if state.strip() else "UNKNOWN"
        try:
            n = int(nodes)
        except ValueError:
            n = 0
        out[jid.strip()] = SlurmJob(jid.strip(), name, state.upper(), reason.strip(), n, nodelist.strip(),
                                    comment.strip())
    return out


def parse_scontrol(text: str) -> dict[str, str]:
    """`scontrol show job ID -o` → {key: value} (values with spaces keep their first word)."""
    return dict(re.findall(r"(?:^|\s)([A-Za-z:/]+)=(\S*)", text))


def sanitized_env(base: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in base.items()
           if not (k.startswith("SLURM_") and k != "SLURM_CONF") and not k.startswith("SBATCH_")
           and not k.startswith("SALLOC_") and not k.startswith("SRUN_")}
    env.pop("ROLLOUTD_TOKEN", None)  # the admin API token: a daemon needs only the join token
    return env


class SlurmExecutor:
    def __init__(self, controller_url: str, join_token: str, data_dir: Path, *,
                 python: str = sys.executable, grace_seconds: float | None = None, max_failures: int = 5,
                 stable_seconds: float = 60.0, finish_grace: float = 15.0, max_backoff: float = 60.0,
                 poll_interval: float = 1.0,
                 extra_env: dict[str, str] | None = None, scheduler: Any = None,
                 event: Callable[[str, str, str, str], None] | None = None,
                 run: Runner | None = None, clock: Callable[[], float] = time.time):
        self.controller_url = controller_url
        self.join_token = join_token
        self.data_dir = data_dir
        self.log_dir = data_dir / "logs"
        self.state_file = data_dir / "slurm-executor.json"
        self.python = python
        drain = float(os.environ.get("ROLLOUTD_DRAIN_SECONDS", "30") or 30)
        self.grace = grace_seconds if grace_seconds is not None else drain + 15.0
        self.max_failures = max_failures
        self.finish_grace = finish_grace
        self.exit_settle = 5.0  # after a drained daemon deregisters, before its node goes back
        self.stable_seconds = stable_seconds
        self.max_backoff = max_backoff
        self.poll_interval = poll_interval
        self.extra_env = extra_env or {}
        self.scheduler = scheduler
        self._event = event
        self._run = run or run_cli
        self.clock = clock
        self.state: dict[str, dict[str, Any]] = self._load()
        self._snap: dict[str, SlurmJob] = {}
        self._snap_at = -1e9
        self._adopted = False
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self.submitted = 0  # sbatch calls by this process (tests, metrics)
        self._dirty = False

    # ------------------------------------------------------------ persistence

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.state_file.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _save(self) -> None:
        self._dirty = False
        self.data_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1, sort_keys=True))
        tmp.replace(self.state_file)

    def _job_state(self, job: RolloutJob) -> dict[str, Any]:
        name, uid = job.metadata.name, job.metadata.uid or ""
        st = self.state.get(name)
        if st is None:
            st = self.state[name] = self._new_state(uid)
            self._dirty = True
        elif st.get("uid") != uid:  # re-created under the same name: the old one's allocations are retired
            new = self._new_state(uid)
            new["retired"] = {**st.get("retired", {}), **{a: self._retire_mark() for a in st.get("allocs", {})}}
            st = self.state[name] = new
            self._dirty = True
        st.pop("released", None)
        return st

    def _retire_mark(self, delay: float = 0.0) -> dict[str, Any]:
        """A retired allocation gets SIGTERM at `term_at` (if still running) and scancel `grace` later."""
        return {"at": self.clock(), "term_at": self.clock() + delay, "term": False, "hard": False}

    @staticmethod
    def _new_state(uid: str) -> dict[str, Any]:
        return {"uid": uid, "allocs": {}, "retired": {}, "failures": 0, "next_submit": 0.0, "last_error": "",
                "submits": 0}

    def _emit(self, job: str, reason: str, message: str, type_: str = "Normal") -> None:
        log.log(logging.WARNING if type_ == "Warning" else logging.INFO, "%s: %s: %s", job, reason, message)
        if self._event is not None:
            try:
                self._event(job, reason, message, type_)
            except Exception:  # noqa: BLE001 - an event is best effort
                log.exception("recording event failed")

    # ------------------------------------------------------------ Slurm CLI

    def _env(self) -> dict[str, str]:
        return sanitized_env(dict(os.environ))

    async def _cli(self, *argv: str, input_: str | None = None,
                   env: dict[str, str] | None = None) -> tuple[int, str, str]:
        return await self._run(list(argv), env or self._env(), input_)

    async def _snapshot(self, max_age: float | None = None) -> dict[str, SlurmJob]:
        """Every job of this user that Slurm still knows (cached for `poll_interval`)."""
        max_age = self.poll_interval if max_age is None else max_age
        now = time.monotonic()
        if now - self._snap_at <= max_age:
            return self._snap
        rc, out, err = await self._cli("squeue", "--me", "-h", "-t", "all", "-o", SQUEUE_FORMAT)
        if rc == 127:
            raise ExecutorError(f"Slurm is not available on this controller: {_last_lines(err)}",
                                reason="SlurmUnavailable", permanent=True)
        if rc != 0:
            raise ExecutorError(f"cannot query Slurm (squeue exit {rc}): {_last_lines(err) or 'no output'}",
                                reason="SlurmUnavailable")
        self._snap, self._snap_at = parse_squeue(out), time.monotonic()
        if not self._adopted:
            self._adopt(self._snap)
        return self._snap

    def _invalidate(self) -> None:
        self._snap_at = -1e9

    def _adopt(self, snap: dict[str, SlurmJob]) -> None:
        """Live allocations tagged by this service that the state file does not know (a controller
        that died between sbatch and saving) become the jobs' own again."""
        self._adopted = True
        known = {a for st in self.state.values() for a in (*st.get("allocs", {}), *st.get("retired", {}))}
        for sj in snap.values():
            tag = sj.tag()
            if not sj.live or not tag.get("uid") or not tag.get("job") or sj.id in known:
                continue
            st = self.state.setdefault(tag["job"], self._new_state(tag["uid"]))
            if st.get("uid") != tag["uid"]:
                continue  # another incarnation of that name: left alone (release() of it retires it)
            st["allocs"][sj.id] = {"nodes": sj.nodes, "submitted": self.clock(), "started": None, "drained": []}
            self._dirty = True
            self._emit(tag["job"], "SlurmAdopted", f"adopted Slurm job {sj.id} ({sj.state}, {sj.nodes} node(s))")
        if self._dirty:
            self._save()

    async def _why_ended(self, sj: SlurmJob | None, alloc_id: str) -> str:
        state = sj.state if sj is not None else "GONE"
        rc, out, _ = await self._cli("scontrol", "show", "job", alloc_id, "-o")
        info = parse_scontrol(out) if rc == 0 else {}
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
        tail = _last_lines(_read_tail(info.get("StdOut", "")), 3)
        if tail and state not in ("CANCELLED", "COMPLETED"):
            msg += f"; output: {tail}"
        return msg

    # ------------------------------------------------------------ Executor

    async def ensure(self, job: RolloutJob, nodes: int) -> None:
        async with self._lock:
            try:
                snap = await self._snapshot()
                await self._sweep_retired(snap)
                st = self._job_state(job)
                await self._account(job, st, snap)
                await self._permanent_pending(job, st, snap)
                have = sum(self._size(m) for m in st["allocs"].values())
                if have > nodes:
                    await self._shrink(job, st, snap, have - nodes)
                    have = sum(self._size(m) for m in st["allocs"].values())
                await self._finish_partial_shrinks(job, st, snap)
                if have < nodes and self.clock() >= st["next_submit"]:
                    await self._submit(job, st, nodes - have)
            finally:
                if self._dirty:
                    self._save()

    async def observe(self, job: RolloutJob) -> list[NodeState]:
        async with self._lock:
            snap = await self._snapshot()
            st = self.state.get(job.metadata.name)
            if st is None:
                return []
            out: list[NodeState] = []
            for aid, meta in st["allocs"].items():
                sj = snap.get(aid)
                if sj is None:
                    out.append(NodeState(f"slurm-{aid}", "pending", f"Slurm job {aid} submitted"))
                elif sj.running:  # one reason per allocation (the reconciler joins them when none registered)
                    names = expand_hostlist(sj.nodelist) or [f"slurm-{aid}"]
                    drained = set(meta.get("drained", []))
                    for i, n in enumerate(names):
                        why = f"Slurm job {aid} RUNNING on {sj.nodelist}; daemons starting" if i == 0 else ""
                        out.append(NodeState(n, "finished" if n in drained else "running", why))
                elif sj.live:
                    why = f"Slurm job {aid} {sj.state} (reason {sj.reason})" if sj.reason not in ("", "None") \
                        else f"Slurm job {aid} {sj.state}"
                    out += [NodeState(f"slurm-{aid}-{i}", "pending", why if i == 0 else "")
                            for i in range(max(meta["nodes"], 1))]
            if not out and st.get("last_error"):
                wait = max(st["next_submit"] - self.clock(), 0)
                why = st["last_error"] + (f"; resubmitting in {wait:.0f}s" if wait >= 1 else "; resubmitting")
                out.append(NodeState(f"{job.metadata.name}-slurm", "lost", why))
            return out

    async def release(self, job: RolloutJob) -> None:
        name = job.metadata.name
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
                st = self.state.get(name)
                if st is None:
                    return
                # a finished job's daemons leave by themselves (the controller tells them the job is
                # done): they get `finish_grace` before SIGTERM; a deleted job's get it at once
                delay = 0.0 if job.metadata.deletion_timestamp is not None else self.finish_grace
                for aid in list(st["allocs"]):
                    st["allocs"].pop(aid)
                    st["retired"][aid] = self._retire_mark(delay)
                st["released"] = True
                self._dirty = True
                await self._sweep_retired(snap)
            finally:
                if self._dirty:
                    self._save()
            if name in self.state:
                self._follow_up()

    async def shutdown(self) -> None:
        """Controller exit: allocations keep running (a restarted controller adopts them)."""
        for t in list(self._tasks):
            t.cancel()

    # ------------------------------------------------------------ steps

    @staticmethod
    def _size(meta: dict[str, Any]) -> int:
        return meta["nodes"] - len(meta.get("drained", []))

    async def _account(self, job: RolloutJob, st: dict[str, Any], snap: dict[str, SlurmJob]) -> None:
        """Allocations that ended without being retired are losses: counted, their daemons forgotten."""
        name = job.metadata.name
        for aid, meta in list(st["allocs"].items()):
            sj = snap.get(aid)
            if sj is not None and sj.live:
                if sj.running and meta.get("started") is None:
                    meta["started"] = self.clock()
                    meta["nodelist"] = sj.nodelist
                    self._dirty = True
                    self._emit(name, "SlurmRunning", f"Slurm job {aid} is running on {sj.nodelist}")
                elif sj.running and st["failures"] and self.clock() - meta["started"] >= self.stable_seconds:
                    st["failures"], st["last_error"] = 0, ""  # healthy again: the crash-loop count starts anew
                    self._dirty = True
                continue
            if sj is None and self.clock() - meta.get("submitted", 0) < 10:
                continue  # just submitted: not in this snapshot yet
            del st["allocs"][aid]
            self._dirty = True
            msg = await self._why_ended(sj, aid)
            started = meta.get("started")
            young = started is None or self.clock() - started < self.stable_seconds
            st["failures"] = st["failures"] + 1 if young else 1
            st["last_error"] = msg
            backoff = 0.0 if st["failures"] <= 1 else min(2.0 ** (st["failures"] - 1), self.max_backoff)
            st["next_submit"] = self.clock() + backoff
            if st["failures"] > self.max_failures:
                self._emit(name, "SlurmAllocationLost", msg, "Warning")
                raise ExecutorError(f"{st['failures']} Slurm allocations in a row ended within "
                                    f"{self.stable_seconds:.0f}s of starting; last: {msg}",
                                    reason="SlurmAllocationFailed", permanent=True)
            self._emit(name, "SlurmAllocationLost", f"{msg}; replacing it"
                       + (f" in {backoff:.0f}s" if backoff else ""), "Warning")

    async def _permanent_pending(self, job: RolloutJob, st: dict[str, Any], snap: dict[str, SlurmJob]) -> None:
        for aid in list(st["allocs"]):
            sj = snap.get(aid)
            if sj is not None and sj.state == "PENDING" and sj.reason in PERMANENT_PENDING:
                st["allocs"].pop(aid)
                st["retired"][aid] = self._retire_mark()
                await self._sweep_retired(snap)
                self._save()
                raise ExecutorError(f"Slurm job {aid} can never start: {sj.reason} ({PERMANENT_PENDING[sj.reason]})",
                                    reason=sj.reason, permanent=True)

    async def _submit(self, job: RolloutJob, st: dict[str, Any], count: int) -> None:
        name, uid = job.metadata.name, job.metadata.uid or ""
        s = job.spec.executor.slurm
        self.log_dir.mkdir(parents=True, exist_ok=True)
        argv = ["sbatch", "--parsable", f"--job-name=rolloutd-{name}", f"--comment=rolloutd uid={uid} job={name}",
                f"--nodes={count}", "--ntasks-per-node=1", "--export=ALL", f"--chdir={self.data_dir}",
                f"--output={self.log_dir / f'slurm-{name}-%j.out'}"]
        for flag, value in (("partition", s.partition), ("time", s.time_limit), ("account", s.account),
                            ("qos", s.qos), ("constraint", s.constraint)):
            if value:
                argv.append(f"--{flag}={value}")
        limit = slurm_minutes(s.time_limit) if s.time_limit else None
        if limit is not None and limit * 60 >= 4 * (self.grace + 30):  # daemons drain before the hard end
            argv.append(f"--signal=TERM@{int(self.grace) + 30}")
        argv += list(s.extra_args)
        script = SCRIPT.format(job=name, uid=uid, setup="\n".join(s.setup), python=shlex.quote(self.python),
                               restarts=RESTARTS)
        env = {**self._env(), **self.extra_env, "ROLLOUTD_CONTROLLER": self.controller_url, "ROLLOUTD_JOB": name,
               "ROLLOUTD_JOIN_TOKEN": self.join_token}
        rc, out, err = await self._cli(*argv, input_=script, env=env)
        self._invalidate()
        if rc == 0 and out.strip():
            aid = out.strip().split(";")[0].strip()
            self.submitted += 1
            st["submits"] = st.get("submits", 0) + 1
            st["allocs"][aid] = {"nodes": count, "submitted": self.clock(), "started": None, "drained": []}
            self._save()
            self._emit(name, "SlurmSubmitted", f"submitted Slurm job {aid} for {count} node(s)")
            return
        text = _last_lines(err or out) or f"sbatch exited {rc}"
        if rc == 127:
            raise ExecutorError(f"Slurm is not available on this controller: {text}", reason="SlurmUnavailable",
                                permanent=True)
        for pattern, reason in SUBMIT_ERRORS:
            if pattern.search(text):
                raise ExecutorError(f"sbatch refused the allocation: {text}", reason=reason, permanent=True)
        st["failures"] += 1
        st["last_error"] = f"sbatch failed: {text}"
        backoff = min(2.0 ** st["failures"], self.max_backoff)
        st["next_submit"] = self.clock() + backoff
        self._save()
        if st["failures"] > self.max_failures:
            raise ExecutorError(f"sbatch failed {st['failures']} times; last: {text}", reason="SlurmSubmitFailed",
                                permanent=True)
        raise ExecutorError(f"sbatch failed (retrying in {backoff:.0f}s): {text}", reason="SlurmSubmitFailed")

    async def _shrink(self, job: RolloutJob, st: dict[str, Any], snap: dict[str, SlurmJob], surplus: int) -> None:
        name = job.metadata.name
        for aid in sorted(st["allocs"], key=lambda a: int(a) if a.isdigit() else 0, reverse=True):
            if surplus <= 0:
                break
            meta = st["allocs"][aid]
            size = self._size(meta)
            sj = snap.get(aid)
            if size <= surplus or sj is None or not sj.running:
                # the whole allocation goes (a pending one is replaced by a smaller one if need be)
                st["allocs"].pop(aid)
                st["retired"][aid] = self._retire_mark()
                surplus -= size
                self._dirty = True
                self._emit(name, "SlurmScaleDown", f"retiring Slurm job {aid} ({size} node(s))")
                continue
            # part of a running allocation: drain the daemons on its last nodes
            names = [n for n in expand_hostlist(sj.nodelist) if n not in meta.get("drained", [])]
            victims = names[len(names) - surplus:] if len(names) > 1 else []
            if not victims:
                continue
            meta.setdefault("drained", []).extend(victims)
            meta["drain_at"] = self.clock()
            self._drain_daemons(name, aid, victims)
            surplus -= len(victims)
            self._dirty = True
            self._emit(name, "SlurmScaleDown", f"draining the daemons on {', '.join(victims)} of Slurm job {aid}")
        if self._dirty:
            await self._sweep_retired(snap)
            self._follow_up()

    async def _finish_partial_shrinks(self, job: RolloutJob, st: dict[str, Any], snap: dict[str, SlurmJob]) -> None:
        """Nodes whose daemons have drained (or the grace ran out) go back to Slurm."""
        for aid, meta in st["allocs"].items():
            drained = meta.get("drained", [])
            sj = snap.get(aid)
            if not drained or sj is None or not sj.running:
                continue
            still = self._daemons_on(job.metadata.name, aid, drained)
            if still and self.clock() - meta.get("drain_at", 0) < self.grace:
                self._drain_daemons(job.metadata.name, aid, drained)  # one that registered since
                continue
            if not still:  # deregistered: give the processes a moment to exit before Slurm kills them
                meta.setdefault("left_at", self.clock())
                self._dirty = True
                if self.clock() - meta["left_at"] < self.exit_settle:
                    continue
            keep = [n for n in expand_hostlist(sj.nodelist) if n not in drained]
            if not keep:
                continue
            rc, _, err = await self._cli("scontrol", "update", f"JobId={aid}", f"NodeList={','.join(keep)}")
            self._invalidate()
            if rc != 0:
                log.warning("could not give back nodes %s of Slurm job %s: %s", drained, aid, _last_lines(err))
                meta["drain_at"] = self.clock()  # try again after another grace period
            else:
                self._emit(job.metadata.name, "SlurmScaleDown", f"gave nodes {', '.join(drained)} of Slurm job {aid} "
                           f"back to Slurm")
                meta["nodes"] = len(keep)
                meta["drained"] = []
                meta.pop("left_at", None)
            self._dirty = True

    async def _sweep_retired(self, snap: dict[str, SlurmJob]) -> None:
        """Retired allocations: SIGTERM when running (daemons drain), scancel when pending or past the
        grace period; forgotten once Slurm reports them ended."""
        now = self.clock()
        for name, st in list(self.state.items()):
            for aid, r in list(st.get("retired", {}).items()):
                sj = snap.get(aid)
                if sj is None or not sj.live:
                    if sj is not None or now - r["at"] > 10:
                        del st["retired"][aid]
                        self._dirty = True
                    continue
                term_at = r.get("term_at", r["at"])
                if sj.running and not r.get("term"):
                    if now < term_at:
                        continue
                    rc, _, err = await self._cli("scancel", "--signal=TERM", aid)
                    r["term"] = True
                    self._dirty = True
                    if rc != 0:
                        log.warning("scancel --signal=TERM %s: %s", aid, _last_lines(err))
                elif (not sj.running or now - term_at > self.grace) \
                        and (not r.get("hard") or now - r.get("hard_at", 0) > 30):
                    rc, _, err = await self._cli("scancel", aid)
                    r["hard"], r["hard_at"] = True, now
                    self._dirty = True
                    self._invalidate()
                    if rc != 0:
                        log.warning("scancel %s: %s", aid, _last_lines(err))
            if not st.get("retired") and not st.get("allocs") and st.get("released"):
                del self.state[name]
                self._dirty = True

    def _follow_up(self) -> None:
        """Keep sweeping retired allocations until Slurm has let them go (also for deleted jobs)."""
        if any(not t.done() for t in self._tasks):
            return

        async def loop() -> None:
            while any(st.get("retired") for st in self.state.values()):
                await asyncio.sleep(min(max(self.poll_interval, 0.5), 2.0))
                try:
                    async with self._lock:
                        await self._sweep_retired(await self._snapshot())
                        if self._dirty:
                            self._save()
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

    # ------------------------------------------------------------ scheduler hooks

    def _nodes(self, job: str) -> list[Any]:
        if self.scheduler is None:
            return []
        try:
            return list(self.scheduler.nodes(job))
        except Exception:  # noqa: BLE001
            log.exception("listing the nodes of %s failed", job)
            return []

    def _drain_daemons(self, job: str, aid: str, hosts: list[str]) -> None:
        ids = [n.id for n in self._nodes(job) if str(getattr(n, "slurm_job_id", "")) == aid and n.name in hosts]
        if ids:
            self.scheduler.drain(job, ids)

    def _daemons_on(self, job: str, aid: str, hosts: list[str]) -> list[str]:
        return [n.id for n in self._nodes(job)
                if str(getattr(n, "slurm_job_id", "")) == aid and n.name in hosts and n.state != "gone"]


def slurm_minutes(limit: str) -> float | None:
    """A Slurm time limit in minutes ('30', '1:30:00', '2-12', '2-12:00:00'); None for unlimited/unknown."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", limit.strip())
    if not m:
        return None
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        return days * 1440 + a * 60 + (b or 0) + (c or 0) / 60
    if c is not None:  # HH:MM:SS
        return a * 60 + b + c / 60
    if b is not None:  # MM:SS
        return a + b / 60
    return float(a)  # MM


def _last_lines(text: str, n: int = 2) -> str:
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    return " | ".join(lines[-n:])


def _read_tail(path: str, size: int = 4096) -> str:
    if not path or path in ("(null)", "/dev/null"):
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(f.tell() - size, 0))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def advertised_url(host: str, port: int) -> str:
    """The controller URL the daemons on compute nodes use: $ROLLOUTD_ADVERTISE_URL, else this host's
    name when listening on every address, else the address it listens on."""
    url = os.environ.get("ROLLOUTD_ADVERTISE_URL")
    if url:
        return url.rstrip("/")
    if host in ("0.0.0.0", "::", ""):
        return f"http://{socket.getfqdn()}:{port}"
    return f"http://{host}:{port}"
