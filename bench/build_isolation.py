"""The cost of sandboxed build steps (issue 24, item 3): today's step runner against the one before it, in one run.

Where it sits: `bench_images.run` adds these rows. "Before" is the step runner as it was (bwrap as real root
with Docker's capabilities in the host's network namespace, no proxy, no size check), kept here only to be
measured; "after" is `build_step.run_in_rootfs` (user and network namespaces, the egress proxy's relay on RUN,
the size bound). Both build the same apt-free Dockerfile, alternating; and both run a bare `RUN true` step
over one rootfs copy, alternating, to show the per-step cost without the base copy's disk noise.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from unittest import mock

from rolloutd.sandbox.image import build as image_build
from rolloutd.sandbox.image.build_step import run_in_rootfs
from rolloutd.sandbox.host.egress import serving
from rolloutd.crds.kit.settings import SandboxSettings
from rolloutd.sandbox.image.rootfs import STEP_PATH, base_rootfs, copy_tree, image_cache_dir
from rolloutd.sandbox.host.syscall_filter import filter_fd

DOCKERFILE = """\
FROM debian:bookworm
ENV APP=/srv/app
WORKDIR $APP
COPY data.txt ./
RUN wc -l data.txt > lines.txt
RUN python3 -c "print(1)" > one.txt
RUN useradd -m agent && chown -R agent /srv/app
USER agent
RUN touch /srv/app/mine
"""
DOCKER_CAPS = ("CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "MKNOD", "NET_RAW", "SETGID", "SETUID", "SETFCAP",
               "SETPCAP", "NET_BIND_SERVICE", "SYS_CHROOT", "KILL", "AUDIT_WRITE")


def before_run_in_rootfs(rootfs: Path, argv: list[str], *, env: dict[str, str], cwd: str = "/",
                         egress: Path | None = None, binds=(), user=None, timeout=None, max_bytes=None):
    """The step runner before issue 24 (root daemon): host network when the step had one, host capabilities."""
    opts = [shutil.which("bwrap"), "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-ipc",
            "--unshare-uts", "--cap-drop", "ALL", *(a for c in DOCKER_CAPS for a in ("--cap-add", f"CAP_{c}"))]
    if egress is None:
        opts.append("--unshare-net")
    opts += ["--bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp"]
    if egress is not None:
        opts += ["--ro-bind", os.path.realpath("/etc/resolv.conf"), "/etc/resolv.conf"]
    for src, dest in binds:
        opts += ["--ro-bind", src, dest]
    opts += ["--clearenv", *(a for k, v in env.items() for a in ("--setenv", k, v)), "--chdir", cwd]
    if user is not None:
        argv = ["setpriv", f"--reuid={user[0]}", f"--regid={user[1]}", "--init-groups", *argv]
    fd = filter_fd()
    try:
        return subprocess.run([*opts, "--seccomp", str(fd), "--", *argv], capture_output=True, text=True,
                              errors="replace", timeout=timeout, stdin=subprocess.DEVNULL, pass_fds=(fd,))
    finally:
        os.close(fd)


@contextlib.contextmanager
def _no_proxy(path):
    class Idle:
        refused: list[str] = []
    Idle.path = path
    yield Idle


@contextlib.contextmanager
def before():
    """image_build as it was: the old step runner, no egress proxy."""
    with mock.patch.object(image_build, "run_in_rootfs", before_run_in_rootfs), \
            mock.patch.object(image_build, "serving", _no_proxy):
        yield


def measure(n: int) -> dict[str, dict[str, list[float]]]:
    """{"build": {"before": [...], "after": [...]}, "step": {...}}: seconds, alternating before/after."""
    cache = image_cache_dir(SandboxSettings.from_env().images)
    base = base_rootfs(cache)
    out = {"build": {"before": [], "after": []}, "step": {"before": [], "after": []}}
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        root = Path(tmp)
        for i in range(n):
            for mode in ("before", "after"):
                ctx = root / f"ctx-{mode}-{i}"
                ctx.mkdir()
                (ctx / "Dockerfile").write_text(DOCKERFILE)
                (ctx / "data.txt").write_text(f"{mode} {i} {time.time_ns()}\n")
                with before() if mode == "before" else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    image = image_build.build_image(ctx, cache=cache, log=lambda m: None)
                    out["build"][mode].append(time.perf_counter() - t0)
                shutil.rmtree(image.path, ignore_errors=True)
        rootfs = root / "rootfs"
        copy_tree(base, rootfs)
        with serving(root / "egress.sock") as proxy:
            for _ in range(n * 5):
                for mode, runner in (("before", before_run_in_rootfs), ("after", run_in_rootfs)):
                    t0 = time.perf_counter()
                    proc = runner(rootfs, ["true"], env={"PATH": STEP_PATH}, egress=proxy.path,
                                  max_bytes=image_build.max_bytes())
                    out["step"][mode].append(time.perf_counter() - t0)
                    assert proc.returncode == 0, proc.stdout
    return out


__all__ = ["before", "before_run_in_rootfs", "measure"]
