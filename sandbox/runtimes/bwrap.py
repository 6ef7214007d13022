"""The default runtime: bubblewrap, rootless; its hooks build the bwrap command line around the server's.

Where it sits: `get_runtime("bwrap")`; the create template (`base.py`) calls the hooks of `BwrapRuntime`
and starts the result; what a sandbox may see is laid out by `hostview.py`, filtered by `syscall_filter.py`.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from rolloutd.crds.kit.settings import SandboxSettings
from ...crds.rolloutjob import SandboxSpec
from ..errors import RuntimeUnavailable, SandboxCreateError
from ..host.footprint import Layout
from ..host import netns
from ..host.hostview import check_mounts, host_mounts
from ..host.netns import RESOLV_CONF, Outbound
from ..launch import HOST_LIB, LaunchConfig, host_loaded, host_loader, runtime_paths, server_argv, server_env
from ..image.rootfs import ImageBuildError, lookup_user, user_home
from ..image.rootpath import ignore_special, inside
from ..host.syscall_filter import filter_fd
from .base import CONTAINED, Identity, Launch, SandboxRuntime

RUN_MB = 16  # /run: sockets and pid files of programs a task starts, not data
SKIP_TOP = {"proc", "dev", "sys", "tmp", "run", "workspace", ".rolloutd", "lost+found"}


def _bwrap_binary() -> str | None:
    return shutil.which("bwrap")


def image_mounts(image: Path, keep: list[str]) -> list[str]:
    """bwrap args laying `image`'s entries on the tmpfs root, leaving room for `keep` paths.

    Each top-level entry is bound read-only (symlinks recreated); a directory
    on the way to a `keep` path is recreated and descended into instead, so the
    host paths in `keep` can be bound at the same place afterwards.
    """
    args: list[str] = []

    def walk(rel: str) -> None:
        try:
            names = sorted(os.listdir(image / rel if rel else image))
        except OSError as e:
            raise SandboxCreateError(f"cannot read image {image}: {e}") from None
        for name in names:
            if not rel and name in SKIP_TOP:
                continue
            sub = f"{rel}/{name}" if rel else name
            src = image / sub
            dest = "/" + sub
            hit = [k for k in keep if k == dest or k.startswith(dest + "/")]
            if hit:
                if dest in hit or src.is_symlink() or not src.is_dir():
                    continue  # the host path replaces it
                args.extend(["--dir", dest])
                walk(sub)
                continue
            if src.is_symlink():
                args.extend(["--symlink", os.readlink(src), dest])
            elif src.is_dir() or src.is_file():
                args.extend(["--ro-bind", str(src), dest])

    walk("")
    return args


def _copy_home(source: Path, dest: Path, uid: int | None, gid: int | None) -> None:
    """The image user's home as a private writable directory (its files, owned by the sandbox's user)."""
    try:
        shutil.copytree(source, dest, symlinks=True, ignore=ignore_special)
    except OSError:  # none in the image, or not readable by an unprivileged daemon: an empty home
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
    if uid is not None:
        for dirpath, dirnames, filenames in os.walk(dest):
            os.lchown(dirpath, uid, gid)
            for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                os.lchown(os.path.join(dirpath, name), uid, gid)


def _parents(path: str) -> list[str]:
    """``--dir`` for each ancestor of `path`: bwrap would create missing ones 0700, closed to the sandbox's user."""
    parts = Path(path).parents
    return [arg for parent in reversed(list(parts)[:-1]) for arg in ("--dir", str(parent))]


def sandbox_uid(settings: SandboxSettings) -> int | None:
    """The host uid sandboxed code runs as when the daemon is root (None: the daemon's own uid)."""
    if os.geteuid() != 0:
        return None
    return settings.sandbox_uid


def image_user(spec: SandboxSpec) -> tuple[int, int, str] | None:
    """(uid, gid, home) of `spec.user` in the image's /etc/passwd; None without one. A user the image
    lacks, root, or a user without a rootfs image: SandboxCreateError."""
    if spec.user is None:
        return None
    if spec.image == "host":
        raise SandboxCreateError("sandbox.user needs a root filesystem image (its /etc/passwd names the user)")
    try:
        uid, gid = lookup_user(Path(spec.image), spec.user)
    except ImageBuildError as e:
        raise SandboxCreateError(f"sandbox.user {spec.user!r}: {e}") from None
    if uid == 0:
        raise SandboxCreateError(f"sandbox.user {spec.user!r} is root: sandboxed code never runs as root")
    return uid, gid, user_home(Path(spec.image), spec.user)


def _writable_home(home: str) -> bool:
    """Whether `home` gets a private writable copy: not /, not in the sandbox's own writable places."""
    return home != "/" and not any(home == p or home.startswith(p + "/") for p in ("/tmp", "/workspace", "/run",
                                                                                    "/dev", "/proc", "/sys"))


class BwrapRuntime(SandboxRuntime):
    """What the sandbox sees (the full list and the reasons: README.md, "Containment"):

    * its own ipc, pid, net, uts and cgroup namespaces: only a loopback
      interface, and with ``spec.network`` a tap with outbound NAT (`netns.py`, slirp4netns), never the
      host's loopback; only its own processes in /proc.
      ``--die-with-parent``: the sandbox dies with the node daemon.
      ``--new-session``: no TIOCSTI into the daemon's terminal.
    * no privileges: under a root daemon no user namespace, and the server drops
      to `sandbox_uid(settings)` (first_bash.become); under an unprivileged one bwrap's user
      namespace and ``--cap-drop ALL``. The seccomp filter (`syscall_filter.py`)
      on every process.
    * a read-only root: a tmpfs ``/`` holding, read-only, the host's allow-list
      (`hostview.host_mounts`) for ``image: host``, or a root filesystem
      directory's entries, then remounted read-only.
    * writable: ``/workspace`` (the per-sandbox host directory `Sandbox.workspace`)
      and private tmpfs ``/tmp``, ``/dev/shm``, ``/run`` with a size.
    * ``/.rolloutd``: the control directory (the server's 0600 socket).
    * ``spec.mounts``, checked by `hostview.check_mounts`.
    * ``spec.user`` (a user of the image): the server drops to its uid and gid (root daemon) or
      bwrap maps the daemon's uid to them (``--uid``/``--gid`` in the user namespace); HOME is
      its home, a private writable copy of the image's.

    The server's interpreter and packages are bound at their host paths
    (`launch.runtime_paths`); under a root daemon it runs on the host's loader and libraries
    (`launch.host_loaded`), never a root filesystem image's. Unprivileged, the image must be able
    to run the host's Python (same glibc family — e.g. a debootstrap of the host's release).
    """

    name = "bwrap"

    @classmethod
    def available(cls) -> str | None:
        if _bwrap_binary() is None:
            return "bwrap is not installed (apt-get install bubblewrap; see .ci/system-packages.sh)"
        return None

    def check(self, spec: SandboxSpec) -> None:
        check_mounts(spec.mounts, self.settings)
        if spec.network and netns.missing():
            raise RuntimeUnavailable(netns.missing())
        if spec.image != "host" and not Path(spec.image).is_dir():
            raise SandboxCreateError(f"image {spec.image!r} is neither 'host' nor a root filesystem directory")
        if spec.image != "host" and os.path.lexists(Path(spec.image) / "etc" / "ld.so.preload"):
            raise SandboxCreateError(f"spec.sandbox.image {spec.image!r}: /etc/ld.so.preload would load its "
                                     "libraries into the sandbox's exec server: an image may not have one")
        image_user(spec)

    def open_fds(self) -> tuple[int, ...]:
        try:
            return (filter_fd(),)
        except RuntimeError as e:  # fail closed: no filter, no sandbox
            raise RuntimeUnavailable(str(e)) from None

    def identity(self, spec: SandboxSpec) -> Identity:
        user = image_user(spec)
        home = user[2] if user and user[2] != "/" else None
        if os.geteuid() != 0:
            return Identity(home=home)  # the user namespace maps the daemon's uid to the image user's
        if user is None:
            return Identity(uid=sandbox_uid(self.settings), gid=sandbox_uid(self.settings))
        return Identity(uid=user[0], gid=user[1], home=home)

    def rlimit_nproc(self, uid: int | None) -> bool:
        return uid is None  # a root daemon's sandboxes all run as one `nobody`: no shared count

    def launch(self, spec: SandboxSpec, layout: Layout, config: LaunchConfig, fds: tuple[int, ...]) -> Launch:
        uid, gid = config.uid, config.gid if config.gid is not None else config.uid
        void = layout.root / "void"  # what hidden directories show: nothing (readable, so that rmtree can remove it)
        void.mkdir(mode=0o555)
        if uid is not None:
            for d in (layout.workspace, layout.ctl):
                os.chown(d, uid, gid)
        image = None if spec.image == "host" else Path(spec.image)
        user = image_user(spec)
        home = user[2] if user and image is not None and _writable_home(user[2]) and not (
            image / user[2].lstrip("/")).is_symlink() else None
        if home is not None:
            _copy_home(inside(image, home), layout.root / "home", uid, gid)  # never through a link to the host
        opts = self._options(spec, image, runtime_paths(), layout, uid, str(void), home)
        if user is not None and uid is None:  # unprivileged: the namespace's ids are the image user's
            opts[:0] = ["--unshare-user", "--uid", str(user[0]), "--gid", str(user[1])]
        (seccomp_fd,) = fds
        outbound = Outbound(layout.id, layout.root / "slirp4netns.log", self.settings.egress_allow) \
            if spec.network else None
        if outbound is not None:
            opts.extend(outbound.bwrap_args())
            resolv = (image or Path("/")) / "etc" / "resolv.conf"
            if resolv.is_file() and not resolv.is_symlink():  # its DNS: slirp4netns's forwarder
                (layout.root / "resolv.conf").write_text(RESOLV_CONF)
                opts.extend(["--ro-bind", str(layout.root / "resolv.conf"), "/etc/resolv.conf"])
        server = server_argv(config)
        if image is not None and uid is not None and host_loader():  # root until `become`: the host's loader
            at = opts.index("--remount-ro")  # while the tmpfs root can still take the mount point
            opts[at:at] = ["--ro-bind", os.path.dirname(host_loader()), HOST_LIB]
            server = host_loaded(server)
        return Launch(
            argv=[_bwrap_binary(), *opts, "--seccomp", str(seccomp_fd), "--", *server],
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, pass_fds=fds + (outbound.pass_fds if outbound else ()),
            enforced={"uid": uid, "seccomp": True, "network": "slirp4netns" if outbound else "none"},
            outbound=outbound,
        )

    @staticmethod
    def _options(spec: SandboxSpec, image: Path | None, keep: list[str], layout: Layout,
                 uid: int | None, void: str, home: str | None = None) -> list[str]:
        # --as-pid-1: the execution server is the namespace's init. Without it
        # bwrap's own init reports the exit through an eventfd and the outer bwrap
        # exits without reaping it: a zombie on hosts whose pid 1 does not reap.
        # As init the server cannot be killed from inside (even by SIGKILL), and
        # its death takes every process of the sandbox with it.
        opts = ["--die-with-parent", "--new-session", "--as-pid-1"]
        if uid is None:  # unprivileged: a user namespace, and bwrap keeps no capability
            opts.extend(["--unshare-all", "--cap-drop", "ALL"])
        else:
            # root: no user namespace (root inside one is still root to every file it can reach);
            # the server keeps only what it needs to become `uid` (which clears them), see first_bash.become
            opts.extend(["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"])
            opts.extend(["--cap-drop", "ALL", *(a for c in ("SETUID", "SETGID", "SETPCAP") for a in ("--cap-add", f"CAP_{c}"))])
        opts.append("--clearenv")  # the server's environment is fixed; the job's goes to its sessions only
        for key, value in server_env(layout.id).items():  # the id: `footprint.reap_leftovers` finds it
            opts.extend(["--setenv", key, value])
        opts.extend(["--tmpfs", "/"])
        opts.extend(host_mounts(void) if image is None else image_mounts(image, [*keep, *([home] if home else [])]))
        for path in keep:
            opts.extend([*_parents(path), "--ro-bind", path, path])
        if Path("/sys").is_dir():
            opts.extend(["--ro-bind", "/sys", "/sys"])
        # /dev: bwrap's minimal device tmpfs, read-only below (the devices still work); its /dev/shm
        # and /run are tmpfs of their own with a size, like /tmp: without a cgroup nothing else
        # would bound what a sandbox keeps in memory-backed files. 1777: the sandbox's user writes there
        tmp_size = ["--size", str(spec.limits.tmp_mb * 1024 * 1024)] if spec.limits.tmp_mb else []
        sticky = ["--perms", "01777"]
        opts.extend(["--proc", "/proc", "--dev", "/dev", *sticky, *tmp_size, "--tmpfs", "/dev/shm"])
        opts.extend([*sticky, *tmp_size, "--tmpfs", "/tmp", *sticky, "--size", str(RUN_MB * 1024 * 1024), "--tmpfs", "/run"])
        for path in keep:  # an interpreter or checkout under /tmp or /run (a CI clone)
            if path.startswith(("/tmp/", "/run/")):  # would be hidden by the private tmpfs above
                opts.extend([*_parents(path), "--ro-bind", path, path])
        opts.extend(["--bind", str(layout.workspace), CONTAINED.workspace, "--bind", str(layout.ctl), CONTAINED.ctl])
        if home is not None:
            opts.extend([*_parents(home), "--bind", str(layout.root / "home"), home])
        base = str(layout.root.parent)  # the settings' sandbox_dir
        if not base.startswith(("/tmp/", "/run/")):
            opts.extend(["--tmpfs", base])  # other sandboxes' workspaces stay hidden
        for m in spec.mounts:
            opts.extend([*_parents(m.inside), "--ro-bind" if m.read_only else "--bind", m.host_path, m.inside])
        opts.extend(["--remount-ro", "/", "--remount-ro", "/dev", "--chdir", CONTAINED.workspace])
        return opts
