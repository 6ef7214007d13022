"""Start the default bash session before the server has finished importing.

Where it sits: the launcher (`rolloutd.sandbox.launch.LAUNCHER`) calls `fork_bash`
first thing, with only builtin modules loaded; `server.main.main` then adopts
the running bash as the ``default`` session. bash's start (~10 ms) thus
overlaps the server's own imports instead of following them. `spawn_bash` is
also how every later session starts. Builtin modules only: importing
ptyprocess (it pulls in shutil, collections, ...) would cost more than the
whole start budget on a busy node.
"""
from __future__ import annotations

import os

BASH_ARGV = ["/bin/bash", "--noprofile", "--norc", "--noediting", "-i"]
SIGKILL = 9
ROWS, COLS = 40, 200


class _Libc:
    """libc's `prctl` and `capset` through `_ctypes` alone: `import ctypes` (its Python layer, struct, ...)
    cost 2-3 ms of CPU at every sandbox start; `_ctypes`, the extension under it, 0.2 ms."""

    def __init__(self) -> None:
        import _ctypes

        class Fn(_ctypes.CFuncPtr):  # int f(...), cdecl: what ctypes.CDLL(None).f is
            _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO

        class Lib:
            _handle = _ctypes.dlopen(None, _ctypes.RTLD_LOCAL)

        class U32(_ctypes._SimpleCData):
            _type_ = "I"

        class Words2(_ctypes.Array):
            _type_, _length_ = U32, 2

        class Words6(_ctypes.Array):
            _type_, _length_ = U32, 6

        self.prctl, self.capset = Fn(("prctl", Lib)), Fn(("capset", Lib))
        self.words2, self.words6 = Words2, Words6


def interruptible() -> None:
    """SIGINT as a normal Python start leaves it. A node daemon started with SIGINT ignored (a script's `daemon &`, a
    test runner's worker) would pass the ignore through bwrap to every bash, command and kernel of the sandbox, and
    no interrupt or timeout could stop a command short of SIGKILL."""
    import signal

    signal.signal(signal.SIGINT, signal.default_int_handler)


def become(cfg: dict) -> None:
    """First thing in the sandbox, before any child: a root runtime's server drops to the
    sandbox's own uid (no groups); changing uid clears every capability it still had.
    The bounding and inheritable sets are emptied too (no_new_privs already makes them
    unusable; where the image's libffi cannot load _ctypes they stay, harmless)."""
    uid = cfg.get("uid")
    if uid is None:
        return
    try:
        libc = _Libc()
    except (ImportError, OSError, AttributeError):
        libc = None
    if libc is not None:
        cap = 0
        while libc.prctl(24, cap, 0, 0, 0) == 0:  # PR_CAPBSET_DROP, up to the kernel's last capability
            cap += 1
    gid = uid if cfg.get("gid") is None else cfg["gid"]
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if libc is not None:  # capset(v3 header, all three sets empty): the inheritable set bwrap left
        libc.capset(libc.words2(0x20080522, 0), libc.words6())


def undumpable(cfg: dict) -> None:
    """No process of the sandbox (same uid) may trace the server or read its memory, fds or
    environment. Its children become dumpable again when they exec (same credentials).

    After `become` the kernel has done it already (a change of uid sets the flag from
    fs.suid_dumpable, 0 by default): no `_ctypes` then, and none needed in an image
    whose libffi the host's `_ctypes` cannot find."""
    if cfg.get("uid") is not None:
        try:
            with open("/proc/sys/fs/suid_dumpable") as f:
                if f.read().strip() == "0":
                    return
        except OSError:
            pass
    import _ctypes

    if _Libc().prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE, 0
        raise OSError(_ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


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


def spawn_bash(cwd: str, env: dict, rlimits: dict, landlock: int | None = None) -> tuple[int, int]:
    """(pid, pty master fd) of a new interactive bash on its own pty and session.

    What ``ptyprocess.PtyProcess.spawn(..., echo=False)`` does, with builtin
    modules only: `os.forkpty` (new session, the pty as controlling terminal
    and stdio), echo and "\n" → "\r\n" off, the window size, the limits, `landlock` (a ruleset fd), then exec.
    """
    pid, fd = os.forkpty()
    if pid == 0:  # child
        try:
            import fcntl
            import struct
            import termios

            attrs = termios.tcgetattr(0)
            attrs[1] &= ~termios.ONLCR  # "\n" stays "\n" (what `stty -onlcr` did, without its fork and exec)
            attrs[3] &= ~termios.ECHO
            termios.tcsetattr(0, termios.TCSANOW, attrs)
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLS, 0, 0))
            apply_limits(rlimits)
            if landlock is not None:  # a confined session (server/confine.py): no exec without it
                from .confine import enter
                enter(landlock)
            os.chdir(cwd)
            os.execve(BASH_ARGV[0], BASH_ARGV, env)
        finally:
            os._exit(127)
    return pid, fd


def fork_bash(cfg: dict) -> tuple[int, int] | None:
    """The default session's bash, started by the launcher; None if it could not start."""
    try:
        return spawn_bash(cfg["workspace"], cfg.get("env") or {}, cfg.get("rlimits") or {})
    except OSError:
        return None
