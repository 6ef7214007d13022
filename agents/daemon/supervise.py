"""Keep one node daemon running for the life of an allocation: restart it, after a back-off, when it crashes.

`rolloutd node --restarts N` (agents/cli.py; the Slurm batch script uses it) runs this; the child runs daemon.py.
Exit 0 and `EXIT_REFUSED` (refused or misconfigured: a restart cannot help) are final; any other exit is a crash,
restarted at most `restarts` times within `window` seconds. SIGTERM/SIGINT are forwarded to the daemon and end
the supervision (under Slurm the daemon also gets the signal itself and ignores the copy: `request_stop`).
"""
from __future__ import annotations

import collections
import signal
import subprocess
import sys
import time

from rolloutd.crds.kit.aiokit import backoff_delay

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
    streak = 0  # crashes since the daemon last ran for a whole window: the back-off grows with it
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
            streak = 0  # it had been running fine for a while: start again at once-ish
        streak += 1
        delay = backoff_delay(streak, initial=backoff, maximum=max_backoff)
        _say(f"the node daemon exited with {_describe(rc)}; starting it again in {delay:g}s "
             f"({len(crashes)} of {restarts} restarts within {window:g}s)")
        deadline = time.monotonic() + delay
        while not stopping and time.monotonic() < deadline:
            time.sleep(0.05)
        if stopping:
            return code


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"code {rc}"


def _say(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} rolloutd-node supervisor: {message}", file=sys.stderr, flush=True)
