"""Resource limits of a sandbox: rlimits everywhere, cgroups where the process may create them.

Where it sits: the create template (`runtimes/base.py`) calls `rlimits_for(spec.limits)` (the numbers
go to the execution server in its `launch.LaunchConfig`, which applies them to every child) and
`Cgroup.create` (joined by the runtime's process just before exec, the server included).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from rolloutd.crds.rolloutjob import SandboxLimits
from ..server.procs import kill_until_gone

CGROUP_JOIN = (  # sh -c CGROUP_JOIN sh DIR... -- ARGV: join each cgroup directory, then exec ARGV
    'while [ "$1" != -- ]; do echo $$ > "$1/cgroup.procs" || exit 125; shift; done; shift; exec "$@"'
)
SERVER_HEADROOM_MB = 256
PIDS_HEADROOM = 64  # the server's threads and the kernel's count as tasks
CGROUP_ROOT = Path("/sys/fs/cgroup")
CPU_PERIOD_US = 100_000  # the quota's period: `cpus` × this much CPU time per period
CPU_SKIPPED = ("no cgroup cpu controller this node may write (cgroup v2 without cpu delegated to the daemon's "
               "cgroup, and no v1 cpu hierarchy): the sandbox has no CPU bound")


def rlimits_for(limits: SandboxLimits, *, nproc: bool) -> dict[str, int]:
    """The execution server's rlimits: ``{"AS", "FSIZE", "NPROC"} → value``.

    Which mechanism stops what:

    * memory — ``RLIMIT_AS`` = ``memory_mb`` per process (a single runaway process
      gets ENOMEM / MemoryError); the cgroup limit, where available, bounds the
      whole sandbox at ``memory_mb`` + `SERVER_HEADROOM_MB` (room for the
      execution server and the IPython kernel).
    * processes — a cgroup ``pids.max`` where available. ``RLIMIT_NPROC`` is set
      too, but the kernel never enforces it for root, and outside a user namespace
      it counts *all* processes of the user, so it is only applied in runtimes that
      give the sandbox its own user namespace (`nproc=True`).
    * file size — ``RLIMIT_FSIZE``.
    * wall time — the server's own watchdog plus a node-side timer (`Sandbox`).
    """
    out: dict[str, int] = {}
    if limits.memory_mb:
        out["AS"] = limits.memory_mb * 1024 * 1024
    if limits.file_size_mb:
        out["FSIZE"] = limits.file_size_mb * 1024 * 1024
    if limits.processes and nproc and os.geteuid() != 0:
        out["NPROC"] = limits.processes + PIDS_HEADROOM
    return out


def _own_cgroups() -> dict[str, str]:
    """controller name (or "" for v2) → this process's cgroup path."""
    out: dict[str, str] = {}
    try:
        text = Path("/proc/self/cgroup").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def candidate_parents() -> list[Path]:
    """The directories our sandboxes' cgroups are created in (below our own cgroups)."""
    own = _own_cgroups()
    if (CGROUP_ROOT / "cgroup.controllers").exists():
        return [CGROUP_ROOT / own.get("", "/").lstrip("/")]
    return [CGROUP_ROOT / kind / own[kind].lstrip("/") for kind in ("memory", "pids", "cpu") if kind in own]


class Cgroup:
    """The cgroup directories of one sandbox (one per v1 controller, or one v2 directory).

    cgroups are created *below the caller's own cgroup* (read from
    /proc/self/cgroup), never elsewhere in the hierarchy, so a sandbox always stays
    inside whatever limits its daemon already runs under. cgroup v1 (memory, pids)
    and v2 (when the caller's cgroup delegates those controllers) are handled; when
    none can be created the sandbox runs with rlimits only and says so in
    `Sandbox.limits`.
    """

    def __init__(self, dirs: list[Path], kinds: list[str]) -> None:
        self.dirs = dirs
        self.kinds = kinds  # e.g. ["memory", "pids"]

    @classmethod
    def create(cls, name: str, memory_mb: int | None, processes: int | None,
               cpus: float | None = None, *, headroom: bool = True) -> "Cgroup | None":
        """`headroom`: room for the execution server on top (a sandbox's); False for an image build's step."""
        own = _own_cgroups()
        dirs: list[Path] = []
        kinds: list[str] = []
        wants: dict[str, object] = {}
        if memory_mb:
            wants["memory"] = (memory_mb + SERVER_HEADROOM_MB * headroom) * 1024 * 1024
        if processes:
            wants["pids"] = processes + PIDS_HEADROOM * headroom
        if cpus:
            wants["cpu"] = max(1000, int(cpus * CPU_PERIOD_US))
        if not wants:
            return None
        if (CGROUP_ROOT / "cgroup.controllers").exists():  # pure v2
            d = CGROUP_ROOT / own.get("", "/").lstrip("/") / f"rolloutd-{name}"
            try:
                d.mkdir()
            except OSError:
                return None
            files = {"memory": "memory.max", "pids": "pids.max", "cpu": "cpu.max"}
            if "cpu" in wants:
                wants["cpu"] = f"{wants['cpu']} {CPU_PERIOD_US}"
            for kind, value in wants.items():
                try:
                    (d / files[kind]).write_text(str(value))
                    kinds.append(kind)
                except OSError:
                    pass
            if not kinds:
                _rmdir(d)
                return None
            return cls([d], kinds)
        files = {"memory": "memory.limit_in_bytes", "pids": "pids.max", "cpu": "cpu.cfs_quota_us"}
        for kind, value in wants.items():
            if kind not in own or not (CGROUP_ROOT / kind).is_dir():
                continue
            d = CGROUP_ROOT / kind / own[kind].lstrip("/") / f"rolloutd-{name}"
            try:
                d.mkdir()
            except OSError:
                continue
            try:
                if kind == "cpu":
                    (d / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                (d / files[kind]).write_text(str(value))
            except OSError:
                _rmdir(d)
                continue
            dirs.append(d)
            kinds.append(kind)
        return cls(dirs, kinds) if dirs else None

    def pids(self) -> set[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return out

    def oom_killed(self) -> bool:
        for d in self.dirs:
            for name in ("memory.oom_control", "memory.events"):
                try:
                    text = (d / name).read_text()
                except OSError:
                    continue
                for line in text.splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and value.strip() not in ("", "0"):
                        return True
        return False

    def pids_hit(self) -> bool:
        """Whether a fork or clone in it was refused at pids.max."""
        for d in self.dirs:
            try:
                for line in (d / "pids.events").read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "max" and value.strip() not in ("", "0"):
                        return True
            except OSError:
                pass
        return False

    def destroy(self, timeout: float = 5.0) -> None:
        """Kill whatever is still inside, then remove the directories."""
        deadline = time.monotonic() + timeout
        kill_until_gone(self.pids, timeout=timeout, pause=0.005)
        for d in self.dirs:
            _rmdir(d, deadline)


def _rmdir(d: Path, deadline: float | None = None) -> None:
    deadline = deadline or time.monotonic() + 2.0
    while True:
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.005)


WORKSPACE_SKIPPED = "the node does not run as root (mounting the bounded workspace needs it): no workspace bound"
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


def bound_workspace(workspace: Path, size_mb: int | None) -> dict[str, object]:
    """Make `workspace` (empty, just created) a tmpfs of `size_mb`: what the sandbox can write there is bounded
    (ENOSPC beyond). Returns what `Sandbox.limits` records: the bound, or the reason it was skipped."""
    if not size_mb:
        return {}
    if os.geteuid() != 0:
        return {"workspace_skipped": WORKSPACE_SKIPPED}
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    options = f"size={size_mb}m,mode=0755".encode()
    if libc.mount(b"tmpfs", str(workspace).encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options) != 0:
        return {"workspace_skipped": f"cannot mount the bounded workspace: {os.strerror(ctypes.get_errno())}"}
    return {"workspace_mb": size_mb}


def unbound_workspace(workspace: Path) -> None:
    """Undo `bound_workspace` (its files go with it); nothing when it was not mounted."""
    if os.path.ismount(workspace):
        import ctypes

        ctypes.CDLL(None, use_errno=True).umount2(str(workspace).encode(), _MNT_DETACH)
