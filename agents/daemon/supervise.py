"""Keep one node daemon running on a node for the life of an allocation: restart it when it crashes.

Where it sits: `rolloutd node --restarts N` (agents/cli.py) runs this instead of the daemon; the
Slurm executor's batch script uses it, so a daemon killed by the OOM killer, a segfault or a bug
does not leave its node idle until the allocation ends. The daemon runs as a child process with
the same command line minus `--restarts`.

Exit codes of the daemon decide: 0 (job done, drained, no more nodes wanted) and `EXIT_REFUSED` (the
controller refused it or its configuration is wrong: a restart cannot help) end the supervisor with
that code; anything else (an exception, a signal, "the controller no longer knows this node") is a
crash and the daemon is started again after a back-off, at most `restarts` times within `window`
seconds. Once SIGTERM or SIGINT arrived nothing is restarted and the supervisor exits with the
daemon's code.

SIGTERM and SIGINT are forwarded to the daemon: whoever signals only the supervisor still stops the
daemon. Under Slurm (which signals every process of a step) the daemon then sees the signal twice
within a moment and ignores the copy (`NodeDaemon.request_stop`); a second signal a second or more
later still means "skip the grace period".
"""
from __future__ import annotations

import collections
import signal
import subprocess
import sys
import time

EXIT_REFUSED = 2


def supervise(argv: list[str], restarts: int, window: float = 600.0, backoff: float = 1.0,
              max_backoff: float = 30.0) -> int:
    """Run `argv` until it ends for good; the code to exit with."""
    stopping: list[str] = []
    child: subprocess.Popen | None = None

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signal.Signals(signum).name)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    crashes: collections.deque[float] = collections.deque()
    delay = backoff
    while True:
        started = time.monotonic()
        child = subprocess.Popen(argv)
        rc = child.wait()
        code = rc if rc >= 0 else 128 - rc  # killed by signal N → 128+N, as a shell reports it
        if rc in (0, EXIT_REFUSED) or stopping:
            return code
        now = time.monotonic()
        crashes.append(now)
        while crashes and now - crashes[0] > window:
            crashes.popleft()
        if len(crashes) > restarts:
            _say(f"the node daemon crashed {len(crashes)} times within {window:g}s (last exit {_describe(rc)}): "
                 "giving up")
            return code
        if now - started > window:
            delay = backoff  # it had been running fine for a while: start again at once-ish
        _say(f"the node daemon exited with {_describe(rc)}; starting it again in {delay:g}s "
             f"({len(crashes)} of {restarts} restarts within {window:g}s)")
        deadline = time.monotonic() + delay
        while not stopping and time.monotonic() < deadline:
            time.sleep(0.05)
        if stopping:
            return code
        delay = min(delay * 2, max_backoff)


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"code {rc}"


def _say(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} rolloutd-node supervisor: {message}", file=sys.stderr, flush=True)
