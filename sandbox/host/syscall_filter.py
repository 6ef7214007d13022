"""The sandbox's seccomp filter: syscalls that only serve an escape answer EPERM.

Where it sits: `runtimes/bwrap.py` passes `filter_fd()` to ``bwrap --seccomp FD``; bwrap
loads it (after no_new_privs) on the execution server, so every process of the
sandbox inherits it. The program is compiled by libseccomp (Debian's
``python3-seccomp``, see .ci/system-packages.sh): in this process if the
bindings import, else once by the system ``python3`` running this very file,
and cached under ``~/.cache/rolloutd/seccomp/`` keyed by this file's content.

Default: allow. Refused with EPERM: mounts, namespaces (``clone``/``unshare``
with a ``CLONE_NEW*`` flag; plain ``clone`` for threads and fork stays
allowed; ``clone3``, whose flags a filter cannot read, answers ENOSYS so libc
falls back to ``clone``), tracing and other processes' memory, the kernel's
module, keyring, bpf, perf, kexec, swap, reboot and io_uring interfaces,
``TIOCSTI``/``TIOCLINUX`` and personality flags that turn off ASLR. System
calls of another ABI (i386/x32) kill the process (libseccomp's default).
"""
from __future__ import annotations

import errno
import functools
import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path

DENY = (
    "mount umount umount2 pivot_root chroot setns fsopen fsconfig fsmount fspick open_tree move_mount "
    "mount_setattr ptrace process_vm_readv process_vm_writev pidfd_getfd kexec_load kexec_file_load bpf "
    "perf_event_open keyctl add_key request_key init_module finit_module delete_module create_module "
    "swapon swapoff reboot open_by_handle_at name_to_handle_at userfaultfd acct quotactl quotactl_fd "
    "lookup_dcookie syslog uselib vhangup iopl ioperm settimeofday clock_settime clock_adjtime adjtimex "
    "nfsservctl io_uring_setup io_uring_enter io_uring_register"
).split()
NEW_NAMESPACES = {  # CLONE_NEW* flags
    "NEWNS": 0x00020000, "NEWCGROUP": 0x02000000, "NEWUTS": 0x04000000, "NEWIPC": 0x08000000,
    "NEWUSER": 0x10000000, "NEWPID": 0x20000000, "NEWNET": 0x40000000,
}
CLONE_NEWTIME = 0x80  # unshare only: in clone's flags this bit is part of the exit signal
TTY_IOCTLS = (0x5412, 0x541C)  # TIOCSTI, TIOCLINUX: type into / drive the terminal
PERSONALITY_FLAGS = (0x0040000, 0x0400000)  # ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC
SYSTEM_PYTHON = "/usr/bin/python3"


def build(out) -> None:
    """Compile the filter with libseccomp and write the BPF program to the open file `out`."""
    import seccomp

    f = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
    eperm = seccomp.ERRNO(errno.EPERM)

    def rule(action, name, *args):
        try:
            f.add_rule(action, name, *args)
        except (RuntimeError, ValueError, OSError):  # not a syscall of this architecture
            pass

    for name in DENY:
        rule(eperm, name)
    for flag in NEW_NAMESPACES.values():
        rule(eperm, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    for flag in (*NEW_NAMESPACES.values(), CLONE_NEWTIME):
        rule(eperm, "unshare", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for request in TTY_IOCTLS:
        rule(eperm, "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, request))
    for flag in PERSONALITY_FLAGS:
        rule(eperm, "personality", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    f.export_bpf(out)


def _cache_path() -> Path:
    key = hashlib.sha256(Path(__file__).read_bytes() + platform.machine().encode()).hexdigest()[:16]
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rolloutd" / "seccomp"
    return base / f"filter-{key}.bpf"


@functools.cache
def program() -> bytes:
    """The compiled BPF program (cached on disk where the cache directory is writable)."""
    path = _cache_path()
    try:
        return path.read_bytes()
    except OSError:
        pass
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        target = tmp
    except OSError:
        target = None
    import tempfile

    with tempfile.TemporaryFile() as scratch:
        try:
            build(scratch)
        except ImportError:
            # the bindings are Debian's, for the system python3; this process may be another one
            scratch.write(_build_with_system_python())
        scratch.seek(0)
        data = scratch.read()
    if not data:
        raise RuntimeError("libseccomp produced an empty filter")
    if target is not None:
        try:
            target.write_bytes(data)
            os.replace(target, path)
        except OSError:
            pass
    return data


def _build_with_system_python() -> bytes:
    try:
        p = subprocess.run([SYSTEM_PYTHON, __file__], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"cannot run {SYSTEM_PYTHON} to build the seccomp filter: {e}") from None
    if p.returncode != 0 or not p.stdout:
        reason = p.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(
            f"cannot build the sandbox's seccomp filter: {reason[0]} "
            "(install Debian's python3-seccomp: bash .ci/system-packages.sh)"
        )
    return p.stdout


def filter_fd() -> int:
    """A fresh descriptor holding the program, at offset 0, for one ``bwrap --seccomp``."""
    data = program()
    fd = os.memfd_create("rolloutd-seccomp", 0)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


if __name__ == "__main__":  # run by the system python3: the BPF program on stdout
    build(sys.stdout.buffer)
    sys.stdout.flush()
