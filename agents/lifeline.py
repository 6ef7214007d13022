"""Run a command so that it and every process it starts die with the process that launched it.

Where it sits: `EngineServer` (agents/engine/server.py) starts vLLM's API server through this file, run by
path with the launcher's Python (stdlib only), as the leader of a new process group. The launcher
holds the write end of a pipe that is this process's stdin: when the launcher dies, however it dies
(`kill -9` included), the kernel closes it, the read here returns EOF and the whole group is ended
(SIGTERM, then SIGKILL after a grace period). PR_SET_PDEATHSIG cannot do this: it reaches direct
children only, while vLLM's EngineCore and its workers are grandchildren of the launcher. The group
is also ended when the command exits by itself, so an EngineCore never outlives its API server.

    python lifeline.py -- CMD [ARG...]     (stdin: the lifeline pipe; exit code: CMD's)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

GRACE_SECONDS = 10.0


def live_group_members(pgid: int) -> list[int]:
    """Pids in process group `pgid` that are still running (zombies excluded: on machines whose
    PID 1 does not reap, killed orphans linger as zombies and `kill -0` still succeeds)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry))
    return alive


def end_group(grace: float = GRACE_SECONDS) -> None:
    """SIGTERM every other member of our process group, SIGKILL those left after `grace` seconds."""
    me, pgid = os.getpid(), os.getpgrp()
    others = [p for p in live_group_members(pgid) if p != me]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in others:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        while others and time.monotonic() < deadline:
            time.sleep(0.1)
            others = [p for p in live_group_members(pgid) if p != me]


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: lifeline.py -- CMD [ARG...]", file=sys.stderr)
        return 2
    # a handler (not SIG_IGN, which exec would pass on to the command): the launcher's stop signals
    # the whole group; the command handles it and we end the group once it has exited
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL)

    def watch() -> None:
        try:
            while os.read(0, 4096):
                pass
        except OSError:
            pass
        end_group()  # the launcher is gone
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()
    code = child.wait()
    end_group()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
