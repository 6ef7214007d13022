"""The local executor (embedded default): node daemons as subprocesses of the controller.

Called by the reconcile through `Executor` (base.py); each daemon is `python -m rolloutd.agents.daemon --slot K` with the
contract in its environment (`base.daemon_env`, with the job's node credential, minted on `ensure` and revoked on
`release`), in its own process group, tracked by pid + start time in `local-executor.json`: a restarted
controller adopts them and only ever signals what it started. A controller stopped on purpose (SIGTERM) releases
them (`release_all`) unless run with --keep-daemons; one killed or crashed leaves them to be adopted, and a
daemon that has not reached it for 20 × leaseSeconds + 60 s exits by itself.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rolloutd.crds.rolloutjob import RolloutJob
from rolloutd.sandbox.server.procs import read_stat

from rolloutd.crds import nodeenv

from .base import Credentials, NodeState, Site, StateFile, crash_count, crash_delay, daemon_argv, daemon_env
from .logs import files_stream, job_files, log_stem, pick

log = logging.getLogger("rolloutd.executor.local")

QUICK_EXIT_SECONDS = 10.0   # a daemon that dies sooner after its start is a crash in a row
MAX_RESTART_DELAY = 30.0


def _proc_start_time(pid: int) -> str | None:
    """Start time (clock ticks since boot) of a live, non-zombie process, as the state file keeps it; None otherwise."""
    st = read_stat(pid)  # PID 1 here does not reap: a zombie counts as dead
    return None if st is None or st.dead else str(st.start)


@dataclass
class _Daemon:
    slot: int
    pid: int
    start_time: str
    popen: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0  # quick deaths in a row before this start

    def alive(self) -> bool:
        if self.popen is not None and self.popen.poll() is not None:
            return False
        return _proc_start_time(self.pid) == self.start_time

    def exit_code(self) -> int | None:
        return self.popen.returncode if self.popen is not None else None


class LocalExecutor:
    kind = "local"
    shares_files = True  # its daemons see this controller's files

    def __init__(self, controller_url: str, credentials: Credentials, data_dir: Path, *,
                 grace_seconds: float = 30.0, python: str = sys.executable, extra_env: dict[str, str] | None = None):
        self.controller_url = controller_url
        self.credentials = credentials
        self.log_dir = data_dir / "logs"
        self.state_file = StateFile(data_dir / "local-executor.json")
        self.grace = grace_seconds
        self.python = python
        self.extra_env = extra_env or {}
        self.daemons: dict[str, dict[int, _Daemon]] = {}
        self._stopping: set[asyncio.Task] = set()
        self._adopt()

    @classmethod
    def from_site(cls, site: Site) -> LocalExecutor:
        """Daemons on this host: they reach the controller at its own address and trust its CA."""
        return cls(site.local_url, site.credentials, site.data_dir, grace_seconds=site.grace_seconds,
                   extra_env={nodeenv.CA_FILE: str(site.ca_file)} if site.ca_file else None)

    # ------------------------------------------------------------ persistence

    def _adopt(self) -> None:
        saved = self.state_file.load()
        if not isinstance(saved, dict):
            return
        for job, slots in saved.items():
            for slot, d in slots.items():
                if _proc_start_time(d["pid"]) == d["startTime"]:
                    self.daemons.setdefault(job, {})[int(slot)] = _Daemon(int(slot), d["pid"], d["startTime"],
                                                                          started=time.monotonic())
                    log.info("adopted node daemon pid %s (job %s slot %s)", d["pid"], job, slot)

    def _save(self) -> None:
        data = {job: {str(s): {"pid": d.pid, "startTime": d.start_time} for s, d in slots.items()}
                for job, slots in self.daemons.items() if slots}
        self.state_file.save(data)

    # ------------------------------------------------------------ Executor

    def _spawn(self, job: str, credential: str, slot: int, restarts: int) -> _Daemon:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = daemon_env(os.environ, self.extra_env, self.controller_url, job, credential)
        logf = open(self.log_dir / f"{log_stem(job)}-node{slot}.log", "ab")
        popen = subprocess.Popen(self.command(slot), env=env,
                                 stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        logf.close()
        start = _proc_start_time(popen.pid) or ""
        log.info("started node daemon pid %s for job %s slot %s", popen.pid, job, slot)
        return _Daemon(slot, popen.pid, start, popen, time.monotonic(), restarts)

    def command(self, slot: int) -> list[str]:
        """The command line of the daemon in `slot` (a subclass may wrap it: `nice`, `taskset`, ...)."""
        return daemon_argv(self.python, "--slot", str(slot))

    async def ensure(self, job: RolloutJob, nodes: int) -> None:
        """Exactly `nodes` daemons: a dead one is restarted (after a back-off when it keeps dying young),
        surplus slots get SIGTERM and drain."""
        name = job.metadata.key
        slots = self.daemons.setdefault(name, {})
        changed = False
        for slot in range(nodes):
            d = slots.get(slot)
            if d is not None and d.alive():
                continue
            restarts = 0
            if d is not None:
                restarts = crash_count(d.restarts, d.started, time.monotonic(), QUICK_EXIT_SECONDS, reset=0)
                if time.monotonic() - d.started < crash_delay(restarts, MAX_RESTART_DELAY, free=0):
                    continue
                log.warning("node daemon slot %s of job %s exited (code %s); restarting", slot, name, d.exit_code())
            slots[slot] = self._spawn(name, self.credentials.mint(job), slot, restarts)
            changed = True
        for slot in [s for s in slots if s >= nodes]:  # scale down: the daemon drains on SIGTERM
            self._terminate(slots.pop(slot))
            changed = True
        if changed:
            self._save()

    async def observe(self, job: RolloutJob) -> list[NodeState]:
        out = []
        for slot, d in sorted(self.daemons.get(job.metadata.key, {}).items()):
            alive = d.alive()
            reason = "" if alive else f"exited with code {d.exit_code()}"
            out.append(NodeState(f"{job.metadata.key}-node{slot}", "running" if alive else "lost", reason))
        return out

    async def release(self, job: RolloutJob) -> None:
        """SIGTERM to every daemon of the job, SIGKILL after the grace period; the job's credential is revoked."""
        self.credentials.revoke(job)
        slots = self.daemons.pop(job.metadata.key, {})
        for d in slots.values():
            self._terminate(d)
        if slots:
            self._save()

    def _terminate(self, d: _Daemon) -> None:
        if not d.alive():
            return
        try:
            os.killpg(d.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        task = asyncio.get_running_loop().create_task(self._kill_after_grace(d))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def _kill_after_grace(self, d: _Daemon) -> None:
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and d.alive():
            await asyncio.sleep(0.1)
        if d.alive():
            log.warning("node daemon pid %s ignored SIGTERM for %.0f s; killing it", d.pid, self.grace)
            try:
                os.killpg(d.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if d.popen is not None:
            d.popen.poll()

    async def logs(self, job: RolloutJob, node: int | None, tail: int, follow: bool):
        """The daemons' log files (`<job>-node<slot>.log`), node K being slot K."""
        name = job.metadata.key
        files = pick(job_files(self.log_dir, re.escape(log_stem(name)) + r"-node(\d+)\.log"), node, name,
                     "node daemon log")
        return files_stream(((f"node{k}", p) for k, p in sorted(files.items())), tail, follow)

    def kill(self, job: str, slot: int) -> int:
        """SIGKILL one daemon (tests and `rolloutctl debug`): returns its pid."""
        d = self.daemons[job][slot]
        os.killpg(d.pid, signal.SIGKILL)
        return d.pid

    def release_all(self) -> int:
        """The controller stops on purpose (SIGTERM, without --keep-daemons): SIGTERM to every daemon it started,
        which hands back its leases and drains (it would give up on its own once the controller has not answered
        for 20 × leaseSeconds + 60 s). Not waited for. The number signalled."""
        n = 0
        for slots in self.daemons.values():
            for d in slots.values():
                if d.alive():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(d.pid, signal.SIGTERM)
                        n += 1
        return n

    async def shutdown(self) -> None:
        """Controller exit: leave daemons running (they are adopted after a restart); `release_all` first
        when the controller was stopped on purpose."""
        for task in list(self._stopping):
            task.cancel()
