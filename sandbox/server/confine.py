"""Landlock for the agent's processes (stdlib only: the exec server runs it). Once the node asks for it
(`Server.op_confine`), every session and kernel the server starts, but the exempt sessions (EVAL's), may
write only beneath the sandbox's writable places other than the control directory, and may neither signal
nor trace a process outside its own domain: a verifier's output and the verifier itself are out of reach.

Unprivileged (Linux 5.13+, ABI 6 for the signal scope); where the kernel lacks it, `ruleset` raises OSError
and the sandbox runs unconfined, as before. Next step: `first_bash.spawn_bash` and the kernel call `enter`.
"""
from __future__ import annotations

import ctypes
import os
import re

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same number on every architecture
_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38

WRITE_FILE, REMOVE_DIR, REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
MAKE = sum(1 << b for b in range(6, 13))  # char, dir, reg, sock, fifo, block, sym
REFER, TRUNCATE = 1 << 13, 1 << 14       # ABI 2, ABI 3
SCOPE_SIGNAL = 1 << 1                     # ABI 6

_OCTAL = re.compile(r"\\([0-7]{3})")  # how mountinfo escapes a space, tab, newline or backslash
_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock {what}: {os.strerror(err)}")
    return ret


def abi() -> int:
    """The kernel's Landlock ABI version; 0 without Landlock (not built in, or disabled at boot)."""
    ret = _libc.syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_VERSION))
    return max(int(ret), 0)


def writable_places(protect: str, always: tuple[str, ...] = ("/dev",)) -> list[str]:
    """The mount points mounted read-write (from /proc/self/mountinfo) and `always` (device nodes are
    written on a read-only /dev), except `protect` and what lies beneath it."""
    places = set(always)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), fields[4])  # \040 (space) and friends
            if "rw" in fields[5].split(","):
                places.add(point)
    fenced = protect.rstrip("/")
    return sorted(p for p in places if p != "/" and p != fenced and not p.startswith(fenced + "/"))


def ruleset(writable: list[str]) -> tuple[int, int]:
    """A Landlock ruleset fd (close-on-exec) allowing writes beneath `writable` only, and the ABI. Built
    once in the server; each confined child enters it."""
    version = abi()
    if version < 1:
        raise OSError(95, "Landlock is not available on this kernel")
    write = WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE | (REFER if version >= 2 else 0) | (
        TRUNCATE if version >= 3 else 0)
    attr = _RulesetAttr(write, 0, SCOPE_SIGNAL if version >= 6 else 0)
    size = ctypes.sizeof(attr) if version >= 6 else 8  # older kernels take the fs field alone
    fd = _check(_libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0)),
                "create_ruleset")
    try:
        for path in writable:
            try:
                parent = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # gone since the mount table was read
            try:
                allowed = write if os.path.isdir(path) else write & (WRITE_FILE | TRUNCATE)
                rule = _PathBeneath(allowed, parent)
                _check(_libc.syscall(_ADD_RULE, ctypes.c_int(fd), ctypes.c_int(_RULE_PATH_BENEATH),
                                     ctypes.byref(rule), ctypes.c_uint32(0)), f"add_rule {path}")
            finally:
                os.close(parent)
    except BaseException:
        os.close(fd)
        raise
    return fd, version


def enter(fd: int) -> None:
    """In a child before exec: restrict it (and all it starts) to the ruleset. Raises OSError."""
    _check(_libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    _check(_libc.syscall(_RESTRICT_SELF, ctypes.c_int(fd), ctypes.c_uint32(0)), "restrict_self")


def confine_server(server, exempt: frozenset[str]) -> dict:
    """`Server.op_confine`: build the ruleset once (the control directory left out), spare `exempt`, and end
    the sessions and kernel running now, so that the next command starts a confined one. `confined` False:
    no Landlock (the reason says why), nothing changed."""
    if server.landlock is None:
        try:
            server.landlock, server.landlock_abi = ruleset(writable_places(server.cfg["ctl_dir"]))
        except OSError as e:
            return {"confined": False, "reason": str(e)}
    server.exempt = exempt
    with server.sessions_lock:
        ended = [server.sessions.pop(n) for n in list(server.sessions) if n not in exempt]
    for session in ended:
        session.kill()
    if server._kernel is not None:
        kernel, server._kernel = server._kernel, None
        kernel.shutdown()
    return {"confined": True, "abi": server.landlock_abi, "signals_scoped": server.landlock_abi >= 6}


__all__ = ["abi", "confine_server", "enter", "ruleset", "writable_places"]
