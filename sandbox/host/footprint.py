"""A sandbox's footprint on the host: its private directory, its cgroup and the processes carrying its id.

Where it sits: `runtimes/base.py` lays out a new sandbox here (`Layout.new`); `sandbox.Sandbox.close`
(and a failed start) removes it all with `reap_leftovers` + `remove`; `sweep_stale` removes what
daemons killed with SIGKILL left behind. Processes are read and killed through `server.procs`.
"""
from __future__ import annotations

import functools
import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .limits import Cgroup, candidate_parents, unbound_workspace
from ..launch import ID_VAR
from ..server.procs import identity, kill_until_gone

OWNER_FILE = "owner"  # "<pid> <start time>" of the daemon that created the sandbox
STALE_AFTER = 60.0  # seconds: younger directories and cgroups may be another daemon's sandbox being created


def sandbox_base_dir(base: Path) -> Path:
    """`base` (the settings' `sandbox_dir`, $ROLLOUTD_SANDBOX_DIR), made 0700 if it is missing."""
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    return base


@dataclass(frozen=True)
class Layout:
    """``<ROLLOUTD_SANDBOX_DIR>/<id>/`` (0700): ``workspace/`` and ``ctl/`` (the server's socket)."""

    id: str
    root: Path

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def ctl(self) -> Path:
        return self.root / "ctl"

    @classmethod
    def new(cls, base: Path) -> "Layout":
        """A fresh id and its private directories under `base` (the first call per base sweeps dead daemons'
        leftovers)."""
        _sweep_once(base)
        sandbox_id = secrets.token_hex(6)
        layout = cls(sandbox_id, sandbox_base_dir(base) / sandbox_id)
        layout.root.mkdir(mode=0o700)
        (layout.root / OWNER_FILE).write_text(identity(os.getpid()) or "")
        layout.workspace.mkdir()
        layout.ctl.mkdir(mode=0o700)
        return layout


def pids_with_id(sandbox_id: str) -> list[int]:
    """Processes whose environment carries this sandbox's id (ours: same user)."""
    needle = f"{ID_VAR}={sandbox_id}".encode()
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.append(int(entry))
    return found


def reap_leftovers(sandbox_id: str, timeout: float = 5.0) -> None:
    """SIGKILL any process still carrying the sandbox's id until none is left."""
    left = kill_until_gone(lambda: pids_with_id(sandbox_id), timeout=timeout, pause=0.002)
    if left:
        print(f"rolloutd.sandbox: processes of sandbox {sandbox_id} survived: {left}", file=sys.stderr)


def remove(root: Path, cgroup: Cgroup | None) -> None:
    """The sandbox's cgroup (killing what is still in it) and its directory."""
    if cgroup is not None:
        cgroup.destroy()
    unbound_workspace(root / "workspace")
    shutil.rmtree(root, ignore_errors=True)


def sweep_stale(base: Path) -> list[str]:
    """Remove what sandboxes of dead daemons left behind (a daemon killed with
    SIGKILL never runs its clean-up; its sandboxes die with it, by
    --die-with-parent, but their directories and cgroups stay): directories
    whose owner process is gone, and our empty ``rolloutd-*`` cgroups that
    have no directory any more. Returns the ids removed."""
    removed = []
    base = sandbox_base_dir(base)
    for entry in os.listdir(base):
        root = base / entry
        try:
            owner = (root / OWNER_FILE).read_text().strip()
        except OSError:
            # being created or removed right now, or left without an owner file:
            # stale only if old and nothing of it runs (its owner is unknown)
            try:
                if time.time() - root.stat().st_mtime < STALE_AFTER or pids_with_id(entry):
                    continue
            except OSError:
                continue
            owner = ""
        pid = owner.split()[0] if owner else ""
        if owner and pid.isdigit() and identity(int(pid)) == owner:
            continue  # its daemon is alive: not ours to touch
        reap_leftovers(entry, timeout=5.0)
        unbound_workspace(root / "workspace")
        shutil.rmtree(root, ignore_errors=True)
        removed.append(entry)
    for parent in candidate_parents():
        try:
            names = [n for n in os.listdir(parent) if n.startswith("rolloutd-")]
        except OSError:
            continue
        for name in names:
            if not (base / name[len("rolloutd-") :]).exists():
                try:
                    # another daemon may be creating this sandbox right now (cgroup made, its
                    # process not in it yet): only old, empty cgroups are leftovers
                    sid = name[len("rolloutd-") :]
                    if sid not in removed and time.time() - (parent / name).stat().st_mtime < STALE_AFTER:
                        continue
                    (parent / name).rmdir()  # fails (and is left) while it holds processes
                except OSError:
                    pass
    return removed


@functools.cache
def _sweep_once(base: Path) -> None:
    try:
        sweep_stale(base)
    except OSError:
        pass
