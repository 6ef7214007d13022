"""One Dockerfile step in a sandbox of its own: `run_in_rootfs`, and the size bound of an image build.

Where it sits: `image_build._build` calls `run_in_rootfs` for each RUN, COPY/ADD and WORKDIR over the image's
root filesystem (a copy of rootfs.py's base); the Dockerfile is the tenant's, so a step is hostile code.
Next step: the rootfs, once every step ran, is finished by `image_build._finalize`.

A step runs in bwrap with its own user, mount, pid, ipc, uts and network namespaces, no_new_privs and the
sandbox's seccomp filter. Under a root daemon the user namespace maps ids 0-65535 to the same host ids (so the
image's files keep their owners, as Docker's) and the step gets Docker's default capabilities minus
CAP_SETFCAP, inside that namespace only: nothing over the host's network, mounts or processes. Its network
namespace has a loopback and nothing else: no host loopback, no interface of the host. A RUN step's only way
out is the filtering egress proxy (egress.py) on a Unix socket bound in, relayed to 127.0.0.1:EGRESS_PORT
inside and given as http_proxy/https_proxy (apt, pip, npm, curl honour them). The size bound: RLIMIT_FSIZE
for any one file, and the rootfs's bytes (every inode at least INODE_BYTES), checked every POLL_SECONDS and after
the step (`SizeLimitExceeded`). The step's other bounds (build_limits.py): a cgroup of its own (memory, pids,
CPU, as a sandbox's, where the node may make one), RLIMIT_AS per process, and a deadline.
"""
from __future__ import annotations

import collections
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from .build_limits import AS_FACTOR, BuildLimits
from ..host.limits import CGROUP_JOIN, Cgroup
from ..relay import RELAY
from .rootfs import ImageBuildError
from .rootpath import inside, resolve
from ..host.syscall_filter import filter_fd

CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
EGRESS_PORT = 3128
EGRESS_SOCKET = "/tmp/.rolloutd-egress.sock"
PROXY_VARS = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")
# Docker's default capabilities for a build step (moby's oci/caps/defaults.go) less SETFCAP: file
# capabilities written in a namespace whose root is the host's uid 0 would hold on the host too
STEP_CAPS = ("CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID", "SETPCAP",
             "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE")
ID_COUNT = 65536  # ids mapped into a step's user namespace (root daemon): 0-65535, nobody included
TMP_MB = 2048     # the step's private /tmp (memory): pip's downloads and builds
POLL_SECONDS = 2.0
INODE_BYTES = 4096  # what each file, directory or link counts at least: 100 000 empty files are 400 MB
OUTPUT_TAIL = 64 * 1024

# Run by the host's python (-I): enter a new user namespace whose ids 0..ID_COUNT-1 are the host's (a forked
# child, still outside, writes the maps: only a process with CAP_SETUID in the parent namespace may), then exec
# argv (bwrap, which then holds capabilities in that namespace only).
USERNS = r"""
import ctypes, os, sys
r, w = os.pipe()
me = os.getpid()
child = os.fork()
if child == 0:
    os.close(w)
    os.read(r, 1)
    for name in ("uid_map", "gid_map"):
        with open(f"/proc/{me}/{name}", "w") as f:
            f.write(f"0 0 {sys.argv[1]}\n")
    os._exit(0)
os.close(r)
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000) != 0:
    sys.exit(f"rolloutd: cannot make a user namespace: {os.strerror(ctypes.get_errno())}")
os.write(w, b"x")
os.close(w)
if os.waitpid(child, 0)[1] != 0:
    sys.exit("rolloutd: cannot map the user namespace's ids")
os.execvp(sys.argv[2], sys.argv[2:])
"""


class SizeLimitExceeded(ImageBuildError):
    """The image's root filesystem grew over the build's size limit."""


def tree_bytes(root: Path, stop_over: int | None = None) -> int:
    """Bytes allocated under `root`, each inode at least INODE_BYTES (links not followed, a hard-linked file once);
    stops once over `stop_over`."""
    total, seen, todo = 0, set(), [str(root)]
    while todo:
        try:
            entries = os.scandir(todo.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += max(st.st_blocks * 512, INODE_BYTES)
                if stat.S_ISDIR(st.st_mode):
                    todo.append(entry.path)
        if stop_over is not None and total > stop_over:
            break
    return total


def run_in_rootfs(rootfs: Path, argv: list[str], *, env: dict[str, str], cwd: str = "/", egress: Path | None = None,
                  binds: list[tuple[str, str]] = (), user: tuple[int, int] | None = None, timeout: float | None = None,
                  max_bytes: int | None = None, bounds: BuildLimits | None = None,
                  timeout_by: str = "") -> subprocess.CompletedProcess:
    """Run `argv` with `rootfs` as a writable root: a Dockerfile step. `egress`: the proxy's socket (a RUN's
    network), None for none. `bounds`: memory, processes and CPU (None: none); `timeout_by` names what set
    `timeout`. Output (stdout and stderr, its last OUTPUT_TAIL bytes) is returned, not raised; a step stopped
    at a bound raises ImageBuildError naming it."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise ImageBuildError("bwrap is not installed (bash .ci/system-packages.sh)")
    outer: list[str] = []
    if max_bytes is not None or bounds is not None:
        outer = ["prlimit"]
        if max_bytes is not None:
            outer.append(f"--fsize={max_bytes}:{max_bytes}")
        if bounds is not None:
            address_space = AS_FACTOR * bounds.memory_mb << 20
            outer.append(f"--as={address_space}:{address_space}")
        outer.append("--")
    opts = [bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-net", "--unshare-cgroup-try"]
    if os.geteuid() == 0:
        outer += [sys.executable, "-I", "-S", "-c", USERNS, str(ID_COUNT)]
        opts += ["--cap-drop", "ALL", *(a for c in STEP_CAPS for a in ("--cap-add", f"CAP_{c}"))]
    else:  # bwrap's own user namespace maps only the daemon's uid (to 0): a chown to another id fails
        opts += ["--unshare-user", "--uid", "0", "--gid", "0", "--cap-add", "ALL"]
    for dest in ("/proc", "/dev", "/tmp", *(dest for _, dest in binds)):  # bwrap would follow a link there
        if resolve(rootfs, dest) != dest:
            raise ImageBuildError(f"{dest} is a link in the image; a build step mounts there, keep it a directory")
    tmp_size = min(TMP_MB << 20, max_bytes) if max_bytes else TMP_MB << 20
    opts += ["--bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", str(tmp_size), "--tmpfs", "/tmp"]
    python = inside(rootfs, "/usr/bin/python3")
    if egress is not None and python.is_file() and not python.is_symlink():
        opts += ["--bind", str(egress), EGRESS_SOCKET]
        ca_here = resolve(rootfs, CA_BUNDLE) == CA_BUNDLE and inside(rootfs, CA_BUNDLE).is_file()
        if ca_here and Path(CA_BUNDLE).exists():  # the host's trust store (a site's TLS-intercepting CA too)
            opts += ["--ro-bind", os.path.realpath(CA_BUNDLE), CA_BUNDLE]
        env = {**{k: f"http://127.0.0.1:{EGRESS_PORT}" for k in PROXY_VARS}, **env}
        relay = ["/usr/bin/python3", "-I", "-S", "-c", RELAY, EGRESS_SOCKET, str(EGRESS_PORT)]
    else:
        relay = []
    for src, dest in binds:
        opts += ["--ro-bind", src, dest]
    opts += ["--clearenv", *(a for k, v in env.items() for a in ("--setenv", k, v)), "--chdir", cwd]
    if user is not None:  # USER: drop to it inside, as Docker does for the following RUN steps
        argv = ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--init-groups", *argv]
    seccomp_fd = filter_fd()  # the sandbox's filter (bwrap sets no_new_privs with it): apt and pip need none of it
    command = [*outer, *opts, "--seccomp", str(seccomp_fd), "--", *relay, *argv]
    cgroup = None
    try:
        if bounds is not None:
            cgroup = Cgroup.create(f"build-{uuid.uuid4().hex[:12]}", bounds.memory_mb, bounds.processes,
                                   bounds.cpus, headroom=False)
        if cgroup is not None:  # joined before exec, as a sandbox's (runtimes/base.py)
            command = ["/bin/sh", "-c", CGROUP_JOIN, "sh", *(str(d) for d in cgroup.dirs), "--", *command]
        proc = _supervise(command, rootfs, timeout, max_bytes, seccomp_fd, timeout_by)
        if proc.returncode != 0 and cgroup is not None:
            _name_the_bound(cgroup, bounds)
        return proc
    finally:
        os.close(seccomp_fd)
        if cgroup is not None:
            cgroup.destroy()


def _name_the_bound(cgroup: Cgroup, bounds: BuildLimits) -> None:
    """A failed step that met its cgroup's bound fails with the bound's name, not only its exit code."""
    if cgroup.oom_killed():  # not a reclaim at the limit (page cache hits it too): a process killed for it
        raise ImageBuildError(f"the step went over the build's memory bound of {bounds.memory_mb} MB "
                              "(ROLLOUTD_BUILD_MEMORY_MB, at most the tenant policy's sandboxMemoryMB)")
    if cgroup.pids_hit():
        raise ImageBuildError(f"the step went over the build's process bound of {bounds.processes} "
                              "(ROLLOUTD_BUILD_PROCESSES, at most the tenant policy's sandboxProcesses)")


def _supervise(command: list[str], rootfs: Path, timeout: float | None, max_bytes: int | None,
               seccomp_fd: int, timeout_by: str = "") -> subprocess.CompletedProcess:
    """Run `command`, keeping its output's tail; kill it at `timeout` or once the rootfs is over `max_bytes`."""
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            pass_fds=(seccomp_fd,))
    tail: collections.deque[bytes] = collections.deque()
    reader = threading.Thread(target=_keep_tail, args=(proc.stdout, tail), daemon=True)
    reader.start()
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            wait = POLL_SECONDS if deadline is None else min(POLL_SECONDS, max(0.0, deadline - time.monotonic()))
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                pass
            if deadline is not None and time.monotonic() >= deadline:
                raise ImageBuildError(f"the step did not finish within {timeout:g}s"
                                      + (f": {timeout_by}" if timeout_by else ""))
            if max_bytes is not None and (used := tree_bytes(rootfs, max_bytes)) > max_bytes:
                raise SizeLimitExceeded(_over_message(used, max_bytes))
        if max_bytes is not None and (used := tree_bytes(rootfs, max_bytes)) > max_bytes:
            raise SizeLimitExceeded(_over_message(used, max_bytes))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(10)
    output = b"".join(tail)[-OUTPUT_TAIL:].decode("utf-8", "replace")
    return subprocess.CompletedProcess(command, proc.returncode, output, "")


def _over_message(used: int, limit: int) -> str:
    return (f"the image is over its size limit of {limit >> 20} MB ({used >> 20} MB and more written; "
            "ROLLOUTD_IMAGE_MAX_MB, or rolloutd image build --max-size-mb)")


def _keep_tail(stream, tail: collections.deque[bytes]) -> None:
    kept = 0
    with stream:
        while chunk := stream.read1(65536):
            tail.append(chunk)
            kept += len(chunk)
            while kept - len(tail[0]) >= OUTPUT_TAIL:
                kept -= len(tail.popleft())


__all__ = ["EGRESS_PORT", "SizeLimitExceeded", "run_in_rootfs", "tree_bytes"]
