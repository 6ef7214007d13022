"""Reading a tenant's data (datasets, Harbor task directories) beneath the roots its policy allows, never as root.

Used by the task handlers' `load` (the controller's dataset expansion) and by the node when it stages a Harbor
task's files into a sandbox (agents/tasks/harbor.py). `roots` is the job's effective policy's `data_roots`
(crds.tenancy); None is an admin's job: read as the process, anywhere, as before (but never through a magic link).
Next step: the image builder's copy of a Dockerfile's build context should read through `read_tree` too.

How a tenant's path is opened:
- It must be absolute, without `..`, and lie beneath one of `roots` (the spec field is named when it does not).
- The root is opened as a directory; the rest with openat2(2) RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS, so no
  `..`, absolute symlink or /proc magic link (/proc/*/root, /proc/*/fd/*) leads out of it; a symlink that stays
  beneath the root is followed. Mount points below a root are crossed (only the admin mounts there, so
  RESOLVE_NO_XDEV would only refuse the admin's own layout). Where openat2 is missing (kernels < 5.6, or a
  container's seccomp profile refusing it: probed once) a walk component by component from the root's fd with
  O_NOFOLLOW does the same, resolving relative links itself and refusing absolute ones and any `..` above the
  root (an admin's job then opens plainly, magic links included).
- Only a regular file with a single link (a hard link could name a file of someone else's beneath the root) or
  a directory; a FIFO, socket or device is refused (opened O_NONBLOCK, so a FIFO cannot stall the reader).
- A size bound per file (`max_bytes`) and per tree.

Never as root: a process running as root opens (and, for trees, reads) a tenant's files in one dedicated thread
whose filesystem identity is nobody: setfsuid/setfsgid to nobody and no supplementary groups. The kernel keeps
credentials per thread and these calls (setgroups as a raw syscall) are not broadcast to the process's other
threads; a non-zero fsuid also clears CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH in that thread. So the kernel
checks every directory on the way and the file itself (mode bits, ACLs, /proc's ptrace checks) exactly as it
would for nobody: a tenant's data must be readable by any user (o+r files, o+x directories). Chosen over
checking mode bits ourselves (every component, ACLs, races) and over a child that setuid()s (a process per
read, which must be able to import this code as nobody). A process that is not root reads as itself: it has no
power over other users' files (do not put a data root around the service's own data directory).

Errors: `DataReadError` names the spec field, the path and a fixed reason, never a byte of the file.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import posixpath
import pwd
import stat
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import BinaryIO, Callable, Sequence, TypeVar

from ..tenancy import beneath
from ..errors import ConfigurationError


T = TypeVar("T")
SOURCE = "spec.tasks.source"
MAX_FILE = 8 << 30        # a dataset (its rows are bounded by the namespace's items quota besides)
MAX_TEXT = 16 << 20       # one text file of a task directory: instruction.md, task.toml, the Dockerfile
MAX_TREE = 1 << 30        # all files of one staged directory together
MAX_LINKS = 40            # symlinks followed in one path (the kernel's own bound)
SYS_OPENAT2 = 437         # the same number on every architecture (syscalls from 424 on are shared)
SYS_SETGROUPS = {"x86_64": 116, "aarch64": 159}
RESOLVE_NO_MAGICLINKS, RESOLVE_BENEATH = 0x02, 0x08
OPEN_FILE = os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK
OPEN_DIR = os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_reader: ThreadPoolExecutor | None = None
_reader_lock = threading.Lock()
_have_openat2: bool | None = None  # probed on first use; False: the O_NOFOLLOW walk

_WHY = {
    errno.EXDEV: "leads out of the data root (a symbolic link, '..' or a magic link)",
    errno.ELOOP: "goes through a link that is not allowed (a /proc magic link or too many symbolic links)",
    errno.ENOENT: "does not exist",
    errno.EACCES: "is not readable by an unprivileged user (data must be readable by any user)",
    errno.EPERM: "is not readable by an unprivileged user (data must be readable by any user)",
    errno.ENOTDIR: "is not a directory, or a part of it is not",
    errno.EISDIR: "is a directory, not a file",
}


class DataReadError(ConfigurationError, ValueError):
    """A tenant's file refused or unreadable: `{field}: {path}: {why}`, never its content."""

    def __init__(self, field: str, path: str, why: str) -> None:
        super().__init__(f"{field}: {path}: {why}")
        self.field, self.path, self.why = field, path, why


@dataclass(frozen=True)
class TreeEntry:
    """One entry of a directory read by `read_tree`: `rel` below it, and the bytes or the link's target."""

    rel: str
    kind: str              # "dir", "file" or "link"
    mode: int = 0o755
    data: bytes = b""
    target: str = ""


# ---------------------------------------------------------------------- the public calls
def open_file(path: str | os.PathLike, roots: Sequence[str] | None, *, field: str = SOURCE,
              max_bytes: int = MAX_FILE) -> BinaryIO:
    """`path` opened for reading (a checked regular file at most `max_bytes` long when opened)."""
    path = os.fspath(path)
    fd = _as_reader(roots, lambda: _open_checked(path, roots, field, max_bytes))
    return os.fdopen(fd, "rb")


def read_bytes(path: str | os.PathLike, roots: Sequence[str] | None, *, field: str = SOURCE,
               max_bytes: int = MAX_FILE) -> bytes:
    with open_file(path, roots, field=field, max_bytes=max_bytes) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise DataReadError(field, os.fspath(path), f"is larger than {max_bytes} bytes")
    return data


def read_text(path: str | os.PathLike, roots: Sequence[str] | None, *, field: str = SOURCE,
              max_bytes: int = MAX_TEXT) -> str:
    """The file as UTF-8 text; text that is not UTF-8 is an error that quotes no byte of it."""
    data = read_bytes(path, roots, field=field, max_bytes=max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataReadError(field, os.fspath(path), f"line {line} is not UTF-8 text") from None


def kind(path: str | os.PathLike, roots: Sequence[str] | None, *, field: str = SOURCE) -> str | None:
    """"dir", "file" (a regular file the reader would accept), "other" (a FIFO, socket or device) or None when
    nothing is there; a path the reader refuses (a link out, unreadable, a hard link) raises `DataReadError`."""
    path = os.fspath(path)

    def probe() -> str | None:
        try:
            fd = _open(path, roots, field, OPEN_FILE)
        except DataReadError as e:
            if e.why in (_WHY[errno.ENOENT], _WHY[errno.ENOTDIR]):
                return None
            raise
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                return "dir"
            if not stat.S_ISREG(st.st_mode):
                return "other"
            _check_file(st, path, roots, field, MAX_FILE)
            return "file"
        finally:
            os.close(fd)
    return _as_reader(roots, probe)


def list_dir(path: str | os.PathLike, roots: Sequence[str] | None, *, field: str = SOURCE) -> list[str]:
    """The names in a directory, sorted."""
    path = os.fspath(path)

    def names() -> list[str]:
        fd = _open(path, roots, field, OPEN_DIR)
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)
    return _as_reader(roots, names)


def read_tree(path: str | os.PathLike, roots: Sequence[str] | None, *, field: str = SOURCE,
              max_bytes: int = MAX_TREE) -> list[TreeEntry]:
    """Every directory, regular file and symbolic link below `path` (links are kept as links, never followed);
    anything else, a hard-linked file (for a tenant) or more than `max_bytes` in all is refused."""
    path = os.fspath(path)

    def walk() -> list[TreeEntry]:
        out: list[TreeEntry] = []
        total = [0]
        top = _open(path, roots, field, OPEN_DIR)
        try:
            _walk_tree(top, "", path, roots, field, max_bytes, total, out)
        except OSError as e:  # a directory below that cannot be listed
            raise DataReadError(field, path, _WHY.get(e.errno, os.strerror(e.errno or errno.EIO))) from None
        finally:
            os.close(top)
        return out
    return _as_reader(roots, walk)


# ---------------------------------------------------------------------- checks
def _check_file(st: os.stat_result, path: str, roots: Sequence[str] | None, field: str, max_bytes: int) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise DataReadError(field, path, _WHY[errno.EISDIR])
    if not stat.S_ISREG(st.st_mode):
        raise DataReadError(field, path, "is not a regular file (a FIFO, socket or device)")
    if roots is not None and st.st_nlink > 1:
        raise DataReadError(field, path, "is a hard link (a file with more than one name is refused)")
    if st.st_size > max_bytes:
        raise DataReadError(field, path, f"is larger than {max_bytes} bytes")


def _open_checked(path: str, roots: Sequence[str] | None, field: str, max_bytes: int) -> int:
    fd = _open(path, roots, field, OPEN_FILE)
    try:
        _check_file(os.fstat(fd), path, roots, field, max_bytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _walk_tree(dir_fd: int, rel: str, path: str, roots, field: str, max_bytes: int, total: list[int],
               out: list[TreeEntry]) -> None:
    for name in sorted(os.listdir(dir_fd)):
        sub = f"{rel}/{name}" if rel else name
        where = f"{path.rstrip('/')}/{sub}"
        try:
            fd = os.open(name, OPEN_FILE | os.O_NOFOLLOW, dir_fd=dir_fd)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise DataReadError(field, where, _WHY.get(e.errno, os.strerror(e.errno))) from None
            out.append(TreeEntry(sub, "link", target=os.readlink(name, dir_fd=dir_fd)))
            continue
        try:
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                out.append(TreeEntry(sub, "dir", mode=stat.S_IMODE(st.st_mode)))
                _walk_tree(fd, sub, path, roots, field, max_bytes, total, out)
                continue
            _check_file(st, where, roots, field, max_bytes - total[0])
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read(max_bytes - total[0] + 1)
            total[0] += len(data)
            if total[0] > max_bytes:
                raise DataReadError(field, path, f"holds more than {max_bytes} bytes")
            out.append(TreeEntry(sub, "file", mode=stat.S_IMODE(st.st_mode), data=data))
        finally:
            os.close(fd)


# ---------------------------------------------------------------------- opening beneath a root
def _open(path: str, roots: Sequence[str] | None, field: str, flags: int) -> int:
    """An fd for `path` (see the module docstring); run in the reader's thread."""
    global _have_openat2
    if _have_openat2 is None:  # missing (ENOSYS), or refused by a container's seccomp profile (EPERM)
        try:
            os.close(_openat2(-100, "/", os.O_PATH | os.O_CLOEXEC, RESOLVE_NO_MAGICLINKS))
            _have_openat2 = True
        except OSError:
            _have_openat2 = False
    try:
        if roots is None:  # the admin's job: anywhere, as the process, but no magic link
            return _openat2(-100, path, flags, RESOLVE_NO_MAGICLINKS) if _have_openat2 else os.open(path, flags)
        if not path.startswith("/") or "\0" in path or ".." in path.split("/"):
            raise DataReadError(field, path, "must be an absolute path without '..'")
        norm = posixpath.normpath(path)
        root = max((r for r in roots if beneath(norm, r)), key=len, default=None)
        if root is None:
            raise DataReadError(field, path, f"is not beneath a data root the policy allows "
                                f"({', '.join(roots) or 'none granted'})")
        rel = posixpath.relpath(norm, root)
        root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if rel == ".":
                return os.open(".", flags, dir_fd=root_fd)
            if _have_openat2:
                return _openat2(root_fd, rel, flags, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
            return _walk_open(root_fd, rel, flags)
        finally:
            os.close(root_fd)
    except OSError as e:
        raise DataReadError(field, path, _WHY.get(e.errno, os.strerror(e.errno or errno.EIO))) from None


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _openat2(dir_fd: int, rel: str, flags: int, resolve: int) -> int:
    how = _OpenHow(flags, 0, resolve)
    fd = _libc.syscall(ctypes.c_long(SYS_OPENAT2), ctypes.c_long(dir_fd), os.fsencode(rel), ctypes.byref(how),
                       ctypes.c_size_t(ctypes.sizeof(how)))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(fd)


def _walk_open(root_fd: int, rel: str, flags: int) -> int:
    """openat2's RESOLVE_BENEATH by hand: one component at a time with O_NOFOLLOW from the root's fd; a relative
    symlink is expanded in place, an absolute one or a `..` above the root is EXDEV."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    stack = [os.dup(root_fd)]
    links = 0
    try:
        while parts:
            name = parts.pop(0)
            if name == "..":
                if len(stack) == 1:
                    raise OSError(errno.EXDEV, "beneath")
                os.close(stack.pop())
                continue
            st = os.stat(name, dir_fd=stack[-1], follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(name, dir_fd=stack[-1])
                links += 1
                if target.startswith("/"):
                    raise OSError(errno.EXDEV, "beneath")
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, "links")
                parts[:0] = [p for p in target.split("/") if p not in ("", ".")]
                continue
            if parts:
                stack.append(os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                     dir_fd=stack[-1]))
            else:
                return os.open(name, flags | os.O_NOFOLLOW, dir_fd=stack[-1])
        return os.open(".", flags, dir_fd=stack[-1])
    finally:
        for fd in stack:
            os.close(fd)


# ---------------------------------------------------------------------- never as root
def _as_reader(roots: Sequence[str] | None, work: Callable[[], T]) -> T:
    """Run `work` as nobody's filesystem identity when this process is root and the job is a tenant's."""
    global _reader
    if roots is None or os.geteuid() != 0:
        return work()
    with _reader_lock:
        if _reader is None:
            _reader = ThreadPoolExecutor(1, thread_name_prefix="rolloutd-data-reader")
    return _reader.submit(_unprivileged, work).result()


def nobody() -> tuple[int, int]:
    """(uid, gid) of the unprivileged identity a root process reads a tenant's data as."""
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def _unprivileged(work: Callable[[], T]) -> T:
    # every time: a setuid() elsewhere in the process (glibc broadcasts it) would have reset this thread too
    uid, gid = nobody()
    number = SYS_SETGROUPS.get(platform.machine())
    if number is None or _libc.syscall(ctypes.c_long(number), ctypes.c_long(0), None) != 0:
        raise DataReadError(SOURCE, "-", "cannot drop the node's groups before reading a tenant's data")
    _libc.setfsgid(ctypes.c_uint32(gid))
    _libc.setfsuid(ctypes.c_uint32(uid))
    if _libc.setfsuid(ctypes.c_uint32(0xFFFFFFFF)) != uid or _libc.setfsgid(ctypes.c_uint32(0xFFFFFFFF)) != gid:
        raise DataReadError(SOURCE, "-", "cannot take an unprivileged identity before reading a tenant's data")
    return work()


__all__ = ["DataReadError", "TreeEntry", "kind", "list_dir", "nobody", "open_file", "read_bytes", "read_text",
           "read_tree"]
