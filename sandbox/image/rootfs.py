"""Root filesystems for `rolloutd image build`: the cached Debian bookworm base, and the image's user database.

Where it sits: `image_build.build_image` asks `base_rootfs(cache)` for the base (made once per set
of parameters with mmdebstrap, else debootstrap) and copies it; build_step.py runs each Dockerfile step
inside the copy, sandboxed. Image *use* is runtimes/bwrap.py's, which asks `lookup_user`/`user_home` here.

As an unprivileged user the base needs mmdebstrap's unshare mode (subuid ranges). The image's
/etc/passwd and /etc/group are read through rootpath.py: a link planted by the Dockerfile never leads
to the host's files.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from rolloutd.crds.errors import InfraError

from .rootpath import read_text, resolve

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
SOURCES = (f"deb {MIRROR} {SUITE} main", f"deb {MIRROR} {SUITE}-updates main",
           f"deb http://deb.debian.org/debian-security {SUITE}-security main")
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates")
STEP_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class ImageBuildError(InfraError, RuntimeError):
    """An image could not be built: a step failed, a tool is missing, the base could not be made."""


def image_cache_dir(path: str | Path) -> Path:
    """Where images live, made if missing: the settings' `images` ($ROLLOUTD_IMAGE_DIR, e.g. a cluster
    filesystem, else `$ROLLOUTD_HOME/images`: ~/.cache/rolloutd/images) or a directory given on the command line."""
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path`.lock: one builder per image, across processes and nodes sharing `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{path}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def base_params() -> dict:
    return {"suite": SUITE, "variant": "minbase", "packages": list(BASE_PACKAGES), "sources": list(SOURCES),
            "format": 1}


def base_rootfs(cache: Path, *, log=print) -> Path:
    """The base root filesystem for these parameters, built once (under a lock) and then reused."""
    params = base_params()
    key = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]
    home = cache / f"base-{key}"
    done = home / "base.json"
    if done.is_file():
        return home / "rootfs"
    with locked(home):
        if done.is_file():
            return home / "rootfs"
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=home))
        t0 = time.monotonic()
        log(f"building the {SUITE} base root filesystem (once; {', '.join(BASE_PACKAGES)}) in {home}")
        _bootstrap(work / "rootfs")
        (work / "rootfs").rename(home / "rootfs")
        shutil.rmtree(work, ignore_errors=True)
        done.write_text(json.dumps({**params, "seconds": round(time.monotonic() - t0, 1)}, indent=1))
        return home / "rootfs"


def _bootstrap(target: Path) -> None:
    include = ",".join(BASE_PACKAGES)
    if shutil.which("mmdebstrap"):
        mode = "root" if os.geteuid() == 0 else "unshare"
        argv = ["mmdebstrap", f"--mode={mode}", "--variant=minbase", f"--include={include}", SUITE, str(target), *SOURCES]
    elif shutil.which("debootstrap") and os.geteuid() == 0:
        argv = ["debootstrap", "--variant=minbase", f"--include={include}", SUITE, str(target), MIRROR]
    else:
        raise ImageBuildError("no way to make a Debian root filesystem: install mmdebstrap (bash .ci/system-packages.sh)"
                              + ("" if os.geteuid() == 0 else "; as a non-root user it needs subuid ranges"))
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ImageBuildError(f"{argv[0]} failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}")
    if argv[0] == "debootstrap":  # mmdebstrap writes the sources itself
        (target / "etc/apt/sources.list").write_text("\n".join(SOURCES) + "\n")


def copy_tree(src: Path, dest: Path) -> None:
    """A full copy (reflinks where the filesystem has them): steps may rewrite files in place."""
    proc = subprocess.run(["cp", "-a", "--reflink=auto", str(src), str(dest)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise ImageBuildError(f"cannot copy {src} to {dest}: {proc.stderr[-1000:]}")


def lookup_user(rootfs: Path, spec: str) -> tuple[int, int]:
    """(uid, gid) of a USER spec (`name`, `uid`, `name:group`, `uid:gid`) from the rootfs' own databases."""
    name, _, group = spec.partition(":")
    passwd = _table(rootfs, "/etc/passwd")
    groups = _table(rootfs, "/etc/group")
    if name.isdigit():
        uid = int(name)
        gid = next((int(f[3]) for f in passwd.values() if f[2] == name), uid)
    elif name in passwd:
        uid, gid = int(passwd[name][2]), int(passwd[name][3])
    else:
        raise ImageBuildError(f"user {name!r} does not exist in the image (create it in a RUN step first)")
    if group:
        if group.isdigit():
            gid = int(group)
        elif group in groups:
            gid = int(groups[group][2])
        else:
            raise ImageBuildError(f"group {group!r} does not exist in the image")
    return uid, gid


def user_home(rootfs: Path, spec: str) -> str:
    """The home directory /etc/passwd gives a USER spec's user, resolved inside the image (links followed as
    the image sees them, never to the host: rootpath.py); "/" when it names none."""
    name = spec.partition(":")[0]
    for fields in _table(rootfs, "/etc/passwd").values():
        if (fields[2] if name.isdigit() else fields[0]) == name and len(fields) >= 6 and fields[5].startswith("/"):
            return resolve(rootfs, fields[5])
    return "/"


def _table(rootfs: Path, path: str) -> dict[str, list[str]]:
    try:
        lines = read_text(rootfs, path).splitlines()
    except OSError:
        return {}
    return {f[0]: f for f in (line.split(":") for line in lines) if len(f) >= 4}


__all__ = ["ImageBuildError", "base_rootfs", "copy_tree", "image_cache_dir", "locked", "lookup_user", "user_home"]
