"""Processes as /proc shows them: the one /proc/PID/stat reader and the one kill-until-gone loop.

Where it sits: stdlib only (builtins on the start path), so that both the in-sandbox server
(`server.bash`, `server.main`) and the node side (`rolloutd.sandbox.sandbox`, `pool`, `limits`,
`leftovers`) use it; each caller decides which processes to look at and kill.
"""
from __future__ import annotations

import os
import time

SIGKILL = 9  # not `signal.SIGKILL`: the signal module imports enum (the server's start budget)
CLK_TCK = os.sysconf("SC_CLK_TCK")


class ProcStat:
    """The fields of /proc/PID/stat this code uses (after ``pid (comm)``, whose comm may hold ')')."""

    __slots__ = ("pid", "state", "ppid", "pgid", "sid", "start")

    def __init__(self, pid: int, fields: list[bytes]) -> None:
        self.pid = pid
        self.state = fields[0].decode()  # "R", "S", "Z" (zombie), "X" (dead) ...
        self.ppid = int(fields[1])
        self.pgid = int(fields[2])
        self.sid = int(fields[3])
        self.start = int(fields[19])  # clock ticks since boot

    @property
    def dead(self) -> bool:
        """Exited but not reaped (a zombie): still listed, no longer running."""
        return self.state in ("Z", "X")


def read_stat(pid: int | str) -> ProcStat | None:
    """The process's stat line, or None when it is gone (or unreadable)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].split()
    if len(fields) < 20:
        return None
    return ProcStat(int(pid), fields)


def all_stats(skip: int | None = None):
    """A `ProcStat` for every process in this pid namespace (but `skip`)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != skip:
            st = read_stat(entry)
            if st is not None:
                yield st


def identity(pid: int) -> str | None:
    """``"<pid> <start time>"``: names one running process even after its pid is reused (None: gone)."""
    st = read_stat(pid)
    if st is None or st.dead:
        return None
    return f"{pid} {st.start}"


def children(pid: int) -> list[int]:
    """The direct children of `pid` (every thread's)."""
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
    except OSError:
        pass
    return out


def kill_until_gone(find, *, timeout: float, pause: float = 0.0) -> list[int]:
    """SIGKILL every pid `find()` returns, again, until it returns none (fork bombs respawn).

    Returns the pids still there after `timeout` seconds ([] when every one is gone)."""
    deadline = time.monotonic() + timeout
    while True:
        left = list(find())
        if not left or time.monotonic() > deadline:
            return left
        for pid in left:
            try:
                os.kill(pid, SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if pause:
            time.sleep(pause)


def boot_ticks() -> int:
    """Now, in the unit of `ProcStat.start`."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * CLK_TCK)


_last_pid_fd: int | None = None


def last_pid() -> int:
    """The last pid allocated in this pid namespace (pids only grow until they wrap).
    Read on every command: through one open file (pread, ~1.5 us; open+read+close
    cost ~17 us)."""
    global _last_pid_fd
    try:
        if _last_pid_fd is None:
            _last_pid_fd = os.open("/proc/sys/kernel/ns_last_pid", os.O_RDONLY)
        return int(os.pread(_last_pid_fd, 32, 0))
    except (OSError, ValueError):
        return 0
