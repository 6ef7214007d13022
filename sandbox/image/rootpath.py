"""Paths of a root filesystem image resolved inside it, the way the image's own processes see them.

Where it sits: `rootfs.lookup_user`/`user_home` (the image's /etc/passwd and /etc/group), the image user's home
that the bwrap runtime copies into a sandbox, and `image_build._finalize` (WORKDIR) ask `inside(root, path)`
for the host path of an image path. Next step: the caller opens that host path; no component of it is a link.

A Dockerfile may plant any link (`RUN ln -s /root /home/agent`, `/etc/passwd -> /etc/shadow`): followed by
the host's kernel, an absolute link leads to the HOST's file, and a daemon running as root would read or copy
it. Here every link is read and resolved against `root`, as a chroot would (`..` stops at the root, an
absolute target starts again at the root); /proc and the like are the image's empty directories, so magic
links never exist. A finished image is never written (sandboxes bind it read-only, and a build step's
processes die with its pid namespace), so nothing changes between this resolution and the open.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from rolloutd.crds.errors import ConfigurationError


MAX_LINKS = 40  # the kernel's ELOOP bound


class OutsideRoot(ConfigurationError, OSError):
    """The path loops through links (more than MAX_LINKS)."""


def resolve(root: Path, path: str) -> str:
    """`path` as the image sees it, with every link resolved inside `root`: an absolute path with no `..`,
    no `.` and no link among its existing components (a missing tail is kept as written, normalised)."""
    done: list[str] = []
    todo = [p for p in path.split("/") if p]
    todo.reverse()
    links = 0
    while todo:
        part = todo.pop()
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        here = root.joinpath(*done, part)
        try:
            st = os.lstat(here)
        except OSError:  # missing (or not a directory on the way): the rest stays lexical
            done.append(part)
            continue
        if not stat.S_ISLNK(st.st_mode):
            done.append(part)
            continue
        links += 1
        if links > MAX_LINKS:
            raise OutsideRoot(f"too many links resolving {path!r} in the image")
        target = os.readlink(here)
        if target.startswith("/"):
            done = []
        todo.extend(reversed([p for p in target.split("/") if p]))
    return "/" + "/".join(done)


def inside(root: Path, path: str) -> Path:
    """The host path of image path `path` under `root`, resolved by `resolve`: never outside `root`."""
    return root.joinpath(*resolve(root, path).split("/")[1:])


def read_text(root: Path, path: str) -> str:
    """An image file's text, read through `inside` and opened without following a last link."""
    fd = os.open(inside(root, path), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file in the image")
        return f.read(1 << 22)


def ignore_special(directory: str, names: list[str]) -> list[str]:
    """For shutil.copytree: leave out what is neither a file, a directory nor a link (a FIFO would block the
    copy, a device node would be read as the host's device)."""
    kept = (stat.S_ISREG, stat.S_ISDIR, stat.S_ISLNK)
    out = []
    for name in names:
        try:
            mode = os.lstat(os.path.join(directory, name)).st_mode
        except OSError:
            continue
        if not any(test(mode) for test in kept):
            out.append(name)
    return out


__all__ = ["OutsideRoot", "ignore_special", "inside", "read_text", "resolve"]
