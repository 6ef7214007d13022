"""Which host paths a sandbox mount (``spec.sandbox.mounts``) may name: the node-independent part of the policy.

Used by `rolloutjob.MountSpec` (a job naming a secret is refused at apply time) and
by `rolloutd.sandbox.host.hostview`, which adds what only the node knows (its data
dirs, symlinks resolved) when the sandbox is created.
"""
from __future__ import annotations

# never mounted into a sandbox, nor any directory above them
SECRET_HOST_PATHS = (
    "/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/etc/sudoers.d", "/etc/ssh", "/etc/munge", "/etc/ssl/private",
    "/etc/slurm", "/run/munge", "/var/run/munge", "/var/lib/munge", "/var/log/munge", "/var/spool/slurm",
    "/var/lib/slurm", "/proc", "/sys", "/dev", "/boot", "/root/.ssh",
)
INNER_RESERVED = ("/", "/tmp", "/run", "/workspace")  # a mount may go below these, not on them
INNER_FORBIDDEN = ("/proc", "/dev", "/sys", "/.rolloutd", "/.rolloutd-host")  # nor anywhere below these
# what the exec server's interpreter loads while it is still root (the dynamic loader, its libraries and
# configuration, the programs): a mount may go neither on, below nor above these
INNER_SERVER = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.preload",
                "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d")


def overlaps(a: str, b: str) -> bool:
    """One path is the other or lies below it."""
    a, b = a.rstrip("/") or "/", b.rstrip("/") or "/"
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def check_mount_paths(host_path: str, inside: str) -> None:
    """ValueError naming the problem: relative, '..', a secret, or a place the sandbox owns."""
    for value in (host_path, inside):
        if not value.startswith("/") or ".." in value.split("/") or "\0" in value:
            raise ValueError(f"mount paths must be absolute, without '..': {value!r}")
    for bad in SECRET_HOST_PATHS:
        if overlaps(host_path, bad):
            raise ValueError(f"mount {host_path!r}: {bad} (or a part of it) is never mounted")
    inner = inside.rstrip("/") or "/"
    if inner in INNER_RESERVED or any(overlaps(inner, p) for p in INNER_FORBIDDEN):
        raise ValueError(f"mount {host_path!r}: {inner} is the sandbox's own")
    for p in INNER_SERVER:
        if overlaps(inner, p):
            raise ValueError(f"mount {host_path!r}: {inner} would cover {p}, which the sandbox's exec server loads "
                             "before it drops its privileges")
