"""What of the host a sandbox may see: the `image: host` allow-list, the secrets hidden in it, the mounts refused.

Where it sits: `runtimes/bwrap.py` lays `host_mounts()` on the sandbox's tmpfs root for
``image: host`` and calls `check_mounts()` on ``spec.mounts`` before it starts
anything (apptainer does the same for its binds).

``image: host`` shows ``/usr``, ``/bin``, ``/sbin``, ``/lib*`` and ``/etc``,
read-only, and nothing else of the host's root: never ``/root``, ``/home``,
``/srv``, ``/opt``, ``/var``, ``/mnt``, ``/boot`` or the project's
checkouts. In ``/etc``, every entry the world cannot read (``shadow``,
``gshadow``, ssh host keys, ``sudoers``, munge's key, ``ssl/private`` ...) and
every entry of `ETC_SECRETS` is covered by an empty file or directory. The
interpreter and packages the execution server needs are bound by the runtime
(`runtime_paths`), never a whole checkout.
"""
from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from rolloutd.crds.kit.settings import SandboxSettings, xdg_data_dir
from rolloutd.crds.mounts import SECRET_HOST_PATHS, check_mount_paths, overlaps
from .footprint import sandbox_base_dir
from ..launch import runtime_paths
from ..errors import SandboxCreateError

HOST_ALLOW = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
# secret whatever their mode (a site may have loosened one)
ETC_SECRETS = (
    "shadow", "shadow-", "gshadow", "gshadow-", "sudoers", "sudoers.d", "munge", "ssl/private",
    "security/opasswd", "slurm/slurmdbd.conf", "slurm/jwt_hs256.key", "slurm/jwt.key", "krb5.keytab",
    "rolloutd",
)
SSH_HOST_KEY_PREFIX = "ssh/ssh_host_"
ETC_TTL = 60.0  # /etc is walked at most this often (a few ms on a normal host)
_etc_cache: tuple[float, list[str], list[str]] | None = None


def hidden_in_etc(etc: str = "/etc") -> tuple[list[str], list[str]]:
    """(files, directories) under `etc` a sandbox must not see: not world-readable, or named secrets."""
    global _etc_cache
    now = time.monotonic()
    if _etc_cache is not None and now - _etc_cache[0] < ETC_TTL and etc == "/etc":
        return _etc_cache[1], _etc_cache[2]
    files: list[str] = []
    dirs: list[str] = []

    def walk(d: str) -> None:
        try:
            entries = list(os.scandir(d))
        except OSError:
            return
        for e in entries:
            rel = e.path[len(etc) + 1 :]
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode):
                continue  # a link into a hidden place is hidden there; elsewhere it shows what is allowed
            named = rel in ETC_SECRETS or (rel.startswith(SSH_HOST_KEY_PREFIX) and not rel.endswith(".pub"))
            if stat.S_ISDIR(st.st_mode):
                if named or (st.st_mode & 0o005) != 0o005:
                    dirs.append(e.path)
                else:
                    walk(e.path)
            elif named or not st.st_mode & 0o004:
                files.append(e.path)

    walk(etc)
    if etc == "/etc":
        _etc_cache = (now, files, dirs)
    return files, dirs


def host_mounts(void_dir: str) -> list[str]:
    """bwrap args laying the allowed host entries on the tmpfs root, with /etc's secrets covered."""
    args: list[str] = []
    for name in HOST_ALLOW:
        src = "/" + name
        if os.path.islink(src):
            args.extend(["--symlink", os.readlink(src), src])
        elif os.path.isdir(src):
            args.extend(["--ro-bind", src, src])
    files, dirs = hidden_in_etc()
    for path in files:
        args.extend(["--ro-bind", "/dev/null", path])
    for path in dirs:
        args.extend(["--ro-bind", void_dir, path])
    # programs expect /var/tmp; it is the sandbox's private /tmp
    args.extend(["--dir", "/var", "--symlink", "../tmp", "/var/tmp"])
    return args


def data_dirs(settings: SandboxSettings) -> list[str]:
    """rolloutd's own state on this node (controller and daemon: the API and join tokens): the data directory by
    the controller's own rule (`crds/kit/settings.py`), its default as well, the client's config and ssh keys."""
    try:
        home = Path.home()
    except (KeyError, RuntimeError):  # no $HOME and no passwd entry: only the explicit ones are known
        home = Path("/nonexistent")
    dirs = [
        str(settings.data_dir),
        str(xdg_data_dir(home)),  # hidden too when $ROLLOUTD_DATA_DIR moved the data elsewhere
        str(Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") / "rolloutd"),
        str(home / ".ssh"),
    ]
    return [os.path.realpath(d) for d in dirs if d]


def forbidden_paths(settings: SandboxSettings) -> list[str]:
    return [*SECRET_HOST_PATHS, *data_dirs(settings), os.path.realpath(sandbox_base_dir(settings.sandbox_dir))]


def check_mounts(mounts: list, settings: SandboxSettings) -> None:
    """Refuse a mount of (or above) a secret or rolloutd's own state, one that does not exist, and one landing
    on, below or above what the exec server runs from (its interpreter, packages, this code): it imports them
    as root, before it drops its privileges. The error names ``spec.sandbox.mounts[i]``."""
    forbidden = forbidden_paths(settings)
    server = runtime_paths()
    for i, m in enumerate(mounts):
        where = f"spec.sandbox.mounts[{i}]"
        try:
            check_mount_paths(m.host_path, m.inside)
        except ValueError as e:
            raise SandboxCreateError(f"{where}: sandbox {e}") from None
        real = os.path.realpath(m.host_path)
        for bad in forbidden:
            if overlaps(real, bad):
                raise SandboxCreateError(f"{where}: sandbox mount {m.host_path!r}: {bad} (or a part of it) is never mounted")
        for path in server:
            if overlaps(m.inside, path):
                raise SandboxCreateError(f"{where}.path: {m.inside} would cover {path}, where the sandbox's exec server "
                                         "runs from on this node (it loads it before it drops its privileges)")
        if not os.path.exists(real):
            raise SandboxCreateError(f"{where}: sandbox mount {m.host_path!r} does not exist on this node")
