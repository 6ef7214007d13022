"""Start the default bash session before the server has finished importing.

Where it sits: the launcher (`rolloutd.sandbox.base.LAUNCHER`) calls `fork_bash`
first thing, with only builtin modules loaded; `server.main.main` then adopts
the running bash as the ``default`` session. bash's start (~10 ms) thus
overlaps the server's own imports instead of following them: it is the larger
part of "sandbox ready". Everything here is what ptyprocess.spawn does, with
builtin modules only (no enum, re, json, or ptyprocess yet).
"""
from __future__ import annotations

import os

BASH_ARGV = ["/bin/bash", "--noprofile", "--norc", "--noediting", "-i"]
ROWS, COLS = 40, 200


def apply_limits(rlimits: dict) -> None:
    """In a child before exec: the spec's rlimits, and SIGPIPE back to default
    (Python ignores it, and the disposition would survive exec)."""
    import _signal
    import resource

    _signal.signal(13, 0)  # SIGPIPE, SIG_DFL
    names = {"AS": resource.RLIMIT_AS, "NPROC": resource.RLIMIT_NPROC, "FSIZE": resource.RLIMIT_FSIZE}
    for key, value in rlimits.items():
        try:
            resource.setrlimit(names[key], (int(value), int(value)))
        except (ValueError, OSError, KeyError):
            pass


def fork_bash(cfg: dict) -> tuple[int, int] | None:
    """(pid, pty master fd) of a bash on a new pty, or None if it could not start."""
    try:
        pid, fd = os.forkpty()
    except OSError:
        return None
    if pid == 0:  # child
        try:
            import fcntl
            import struct
            import termios

            attrs = termios.tcgetattr(0)
            attrs[3] &= ~termios.ECHO
            termios.tcsetattr(0, termios.TCSANOW, attrs)
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
            apply_limits(cfg.get("rlimits") or {})
            os.chdir(cfg["workspace"])
            os.execve(BASH_ARGV[0], BASH_ARGV, cfg.get("env") or {})
        finally:
            os._exit(127)
    return pid, fd
