"""`rolloutd image build`: a Dockerfile + build context → a root filesystem bwrap runs (`sandbox.image`).

Where it sits: called by the CLI (image_cli.py) and by the `harbor` task handler's INIT
(`rolloutd.agents.tasks.harbor`); parses with dockerfile.py, builds with rootfs.py. Next step: the
returned `Image.rootfs` goes into a `SandboxSpec(image=...)`, with `Image.env`.

Cache: `<cache>/<key>/` where key = sha256(builder format, base parameters, Dockerfile, build args,
every context file's path, mode and content). A finished image has `image.json`; a build runs under
`<key>.lock`, so concurrent INITs (and nodes sharing the cache directory) build it once.

Made for bwrap's read-only root: the final WORKDIR becomes a symlink to `/workspace` (its files are
kept in `<key>/workdir/` and copied into each sandbox's workspace by the caller: `seed_workspace`),
and `/logs`, `/tests`, `/solution` are symlinks into the sandbox's control directory (`HARBOR_ROOT`). An
Apptainer definition (`Apptainer.def`, bootstrapping from the rootfs) is written beside it; a `.sif`
is built through spython where an apptainer binary exists.
"""
from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shlex
import shutil
import stat
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from rolloutd.crds.kit.settings import SandboxSettings
from .build_limits import BuildLimits, Deadline, for_build
from .build_step import SizeLimitExceeded, run_in_rootfs
from .dockerfile import Dockerfile, DockerfileError, Step, TAR_SUFFIXES, load_dockerfile
from ..host.egress import serving
from .rootfs import STEP_PATH, ImageBuildError, base_params, base_rootfs, copy_tree, image_cache_dir, locked, lookup_user
from .rootpath import ignore_special, resolve

# 2: /logs, /tests and /solution point into the control directory (was /tmp/.harbor). 3: steps sandboxed (user
# and network namespaces, the egress proxy), no setuid/setgid file: an image an older builder made is rebuilt
FORMAT = 3
MAX_MB_ENV = "ROLLOUTD_IMAGE_MAX_MB"
DEFAULT_MAX_MB = 8192  # the root filesystem's bytes, base included (the base is ~260 MB)
SIGXFSZ = 25
CONTEXT = "/.rolloutd-context"
HARBOR_DIRS = ("logs", "tests", "solution")
# In the sandbox's control directory, which a confined agent cannot write (sandbox/server/confine.py): what
# the verifier reads and writes there is out of reach of any process the agent left. /logs/agent is a
# symlink the task's INIT makes to /tmp/.harbor/logs-agent, where the agent writes.
HARBOR_ROOT = "/.rolloutd/harbor"
HARBOR_TMP = "/tmp/.harbor"
# a WORKDIR that is one of these stays a plain (read-only) directory: replacing it would break the system
SYSTEM_DIRS = {"/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib64", "/opt", "/proc", "/root", "/run",
               "/sbin", "/srv", "/sys", "/tmp", "/usr", "/usr/bin", "/usr/lib", "/usr/local", "/usr/local/bin",
               "/usr/local/lib", "/usr/share", "/var", "/workspace"}
PYTHON_FLAVOR = (  # what python:3.x images offer and Debian's python3 lacks: python/pip on PATH, pip installs allowed
    "ln -sf /usr/bin/python3 /usr/local/bin/python && "
    "printf '#!/bin/sh\\nexec /usr/bin/python3 -m pip \"$@\"\\n' > /usr/local/bin/pip && "
    "chmod 755 /usr/local/bin/pip && cp /usr/local/bin/pip /usr/local/bin/pip3 && "
    "rm -f /usr/lib/python3*/EXTERNALLY-MANAGED"
)


@dataclass
class Image:
    key: str
    path: Path                   # <cache>/<key>
    base: str
    python: str
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str | None = None
    writable_workdir: bool = False
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    cached: bool = False

    @property
    def rootfs(self) -> Path:
        return self.path / "rootfs"

    @property
    def seed(self) -> Path:
        return self.path / "workdir"

    def seed_workspace(self, workspace: Path) -> None:
        """Copy the image's WORKDIR files into a sandbox's (empty) workspace, where `WORKDIR` points."""
        if self.writable_workdir and self.seed.is_dir():
            shutil.copytree(self.seed, workspace, symlinks=True, dirs_exist_ok=True, ignore=ignore_special)


def image_key(context: Path, dockerfile: Path, build_args: dict[str, str]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"format": FORMAT, "base": base_params(), "args": build_args}, sort_keys=True).encode())
    h.update(dockerfile.read_bytes())
    for path in sorted(context.rglob("*")):
        rel = path.relative_to(context).as_posix()
        st = path.lstat()
        h.update(f"\0{rel}\0{st.st_mode:o}\0".encode())
        if path.is_symlink():
            h.update(os.readlink(path).encode())
        elif path.is_file():
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()[:24]


def find_dockerfile(directory: Path) -> tuple[Path, Path]:
    """(context, Dockerfile) of a Harbor task directory (environment/Dockerfile) or a build context."""
    for context in (directory / "environment", directory):
        if (context / "Dockerfile").is_symlink():  # read as root: a link could name any file of the host
            raise ImageBuildError(f"{context / 'Dockerfile'}: the Dockerfile is a symbolic link; give the file itself")
        if (context / "Dockerfile").is_file():
            return context, context / "Dockerfile"
    raise ImageBuildError(f"{directory}: no environment/Dockerfile (Harbor task) and no Dockerfile")


def load_image(path: Path) -> Image:
    meta = json.loads((path / "image.json").read_text())
    meta["path"] = path
    return Image(**{k: v for k, v in meta.items() if k in Image.__dataclass_fields__})


def max_bytes(max_mb: int = DEFAULT_MAX_MB) -> int:
    """The build's size bound, `max_mb` (the settings' $ROLLOUTD_IMAGE_MAX_MB, or --max-size-mb), in bytes."""
    mb = int(max_mb)
    if mb <= 0:
        raise ImageBuildError(f"the image size limit must be positive, got {mb} MB")
    return mb << 20


def build_image(directory: str | Path, *, cache: str | Path | None = None, build_args: dict[str, str] | None = None,
                timeout: float | None = None, log=print, max_mb: int | None = None,
                settings: SandboxSettings | None = None, bounds: BuildLimits | None = None) -> Image:
    """The image of `directory`'s Dockerfile: from the cache, or built now (under a lock), at most `max_mb`
    MB of root filesystem (`max_bytes`). `settings`: the node's (image cache, size bound, egress allow-list,
    build bounds; None: the defaults); `cache` and `max_mb` override them, `bounds` its build bounds (a tenant's:
    `build_limits.for_build(settings, quotas)`), `timeout` the step timeout."""
    settings = settings or SandboxSettings()
    bounds = bounds or for_build(settings)
    if timeout is not None:
        bounds = replace(bounds, step_seconds=min(bounds.step_seconds, timeout))
    limit = max_bytes(max_mb if max_mb is not None else settings.image_max_mb)
    context, dockerfile = find_dockerfile(Path(directory).resolve())
    build_args = dict(build_args or {})
    parsed = load_dockerfile(dockerfile, build_args)  # errors name the line before anything is built
    for step in parsed.steps:
        if step.op in ("COPY", "ADD"):
            for pattern in step.args[:-1]:
                _context_matches(context, pattern, step.line)
    cache_dir = image_cache_dir(cache or settings.images)
    key = image_key(context, dockerfile, build_args)
    dest = cache_dir / key
    if (dest / "image.json").is_file():
        return _cached(dest)
    with locked(dest):
        if (dest / "image.json").is_file():
            return _cached(dest)
        for stale in cache_dir.glob(f"{key}-*"):  # a build of this key killed half-way (we hold its lock)
            shutil.rmtree(stale, ignore_errors=True)
        t0 = time.monotonic()
        base = base_rootfs(cache_dir, log=log)
        work = Path(tempfile.mkdtemp(prefix=f"{key}-", dir=cache_dir))
        work.chmod(0o755)  # readable by every user of a shared cache, like the base
        try:
            image = _build(parsed, context, base, work, key, _Limits(Deadline(bounds), limit, settings.egress_allow), log)
            image.seconds = round(time.monotonic() - t0, 2)
            meta = {k: v for k, v in asdict(image).items() if k not in ("path", "cached")}
            (work / "image.json").write_text(json.dumps(meta, indent=1))
            shutil.rmtree(dest, ignore_errors=True)
            work.rename(dest)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        image.path = dest
        return image


def _cached(dest: Path) -> Image:
    image = load_image(dest)
    image.cached = True
    return image


@dataclass
class _Limits:
    deadline: Deadline     # the build's clock and each step's bounds
    max_bytes: int         # the root filesystem's
    egress_allow: tuple = ()  # networks the steps' egress proxy may reach although private


def _build(parsed: Dockerfile, context: Path, base: Path, work: Path, key: str, limits: _Limits, log) -> Image:
    rootfs = work / "rootfs"
    copy_tree(base, rootfs)
    env: dict[str, str] = {"PATH": STEP_PATH}
    if parsed.base.flavor == "python":
        env["LANG"] = "C.UTF-8"
        _step(rootfs, ["/bin/sh", "-c", PYTHON_FLAVOR], env, "/", None, "FROM", 0, limits)
    sockets = Path(tempfile.mkdtemp(prefix="rolloutd-egress-"))  # 0700: the build's steps reach it, bound in
    try:
        with serving(sockets / "egress.sock", limits.egress_allow) as proxy:
            cwd, user = _replay(parsed, context, rootfs, env, limits, log, proxy)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    image = Image(key=key, path=work, base=parsed.base.ref, python=parsed.base.python, env=env, workdir=cwd,
                  user=user, notes=list(parsed.notes))
    _finalize(image, rootfs, work)
    _apptainer(image, work, log)
    return image


def _replay(parsed: Dockerfile, context: Path, rootfs: Path, env: dict[str, str], limits: _Limits, log,
            proxy) -> tuple[str, str | None]:
    """Run the Dockerfile's steps over `rootfs` (`env` is updated); the final (WORKDIR, USER)."""
    args: dict[str, str] = {}
    cwd, user = "/", None
    for step in parsed.steps:
        if step.op == "RUN":
            argv = list(step.args) if step.exec_form else ["/bin/sh", "-c", step.args[0]]
            log(f"Dockerfile:{step.line}: RUN {' '.join(step.args)[:120]}")
            _step(rootfs, argv, {**args, **env}, cwd, user and lookup_user(rootfs, user), "RUN", step.line, limits,
                  egress=proxy.path)
            while proxy.refused:
                log(f"Dockerfile:{step.line}: egress refused {proxy.refused.pop(0)}")
        elif step.op in ("COPY", "ADD"):
            script = _copy_script(step, context, cwd)
            _step(rootfs, ["/bin/sh", "-ec", script], env, "/", None, step.op, step.line, limits,
                  binds=[(str(context), CONTEXT)])
        elif step.op == "WORKDIR":
            cwd = posixpath.normpath(posixpath.join(cwd, step.args[0]))
            _step(rootfs, ["mkdir", "-p", cwd], env, "/", None, "WORKDIR", step.line, limits)
        elif step.op == "ENV":
            env.update(step.options)
        elif step.op == "ARG":
            args.update(step.options)
        elif step.op == "USER":
            user = step.args[0]
    return cwd, user


def _step(rootfs: Path, argv: list[str], env: dict[str, str], cwd: str, user, op: str, line: int, limits: _Limits,
          *, egress: Path | None = None, binds=()) -> None:
    where = f"Dockerfile:{line}" if line else "base"
    timeout, timeout_by = limits.deadline.step_timeout()
    try:
        proc = run_in_rootfs(rootfs, argv, env=env, cwd=cwd, user=user, egress=egress, binds=list(binds),
                             timeout=timeout, max_bytes=limits.max_bytes, bounds=limits.deadline.limits,
                             timeout_by=timeout_by)
    except ImageBuildError as e:
        raise type(e)(f"{where}: {op}: {e}") from None
    if proc.returncode != 0:
        output = proc.stdout[-3000:]
        if proc.returncode in (-SIGXFSZ, 128 + SIGXFSZ):
            raise SizeLimitExceeded(f"{where}: {op} wrote a file over the image's size limit of "
                                    f"{limits.max_bytes >> 20} MB ({MAX_MB_ENV}, or rolloutd image build --max-size-mb)")
        raise ImageBuildError(f"{where}: {op} failed with exit code {proc.returncode}:\n{output}")


def _copy_script(step: Step, context: Path, cwd: str) -> str:
    """A shell script run in the rootfs with the context bound at CONTEXT: Docker's COPY/ADD rules."""
    *sources, dest = step.args
    dest_abs = posixpath.join(cwd, dest)
    into_dir = dest.endswith("/") or len(sources) > 1
    opts = dict(step.options)
    lines: list[str] = []
    q = shlex.quote
    for pattern in sources:
        matches = _context_matches(context, pattern, step.line)
        for rel in matches:
            src = q(f"{CONTEXT}/{rel}" if rel != "." else CONTEXT)
            path = context / rel
            target = dest_abs.rstrip("/") or "/"
            if step.op == "ADD" and path.is_file() and rel.endswith(TAR_SUFFIXES):
                lines.append(f"mkdir -p {q(target)} && tar -xf {src} -C {q(target)}")
                changed = target
            elif path.is_dir():
                lines.append(f"mkdir -p {q(target)} && cp -a --no-preserve=ownership {src}/. {q(target)}/")
                changed = target
            else:
                lines.append(f"t={q(target)}; if [ {int(into_dir)} = 1 ] || [ -d \"$t\" ]; then mkdir -p \"$t\"; "
                             f"t=\"$t\"/{q(posixpath.basename(rel))}; else mkdir -p \"$(dirname \"$t\")\"; fi; "
                             f"cp -a --no-preserve=ownership {src} \"$t\"")
                changed = '"$t"'
            ref = changed if changed == '"$t"' else q(changed)
            if "chown" in opts:
                lines.append(f"chown -R {q(opts['chown'])} {ref}")
            if "chmod" in opts:
                lines.append(f"chmod -R {opts['chmod']} {ref}")
    return "\n".join(lines) or "true"


def _context_matches(context: Path, pattern: str, line: int) -> list[str]:
    pattern = pattern.lstrip("/") or "."
    if ".." in Path(pattern).parts:
        raise ImageBuildError(f"Dockerfile:{line}: {pattern!r} leaves the build context")
    found = sorted(str(p.relative_to(context)) for p in context.glob(pattern)) if any(
        c in pattern for c in "*?[") else ([pattern] if (context / pattern).exists() or pattern == "." else [])
    if not found:
        raise ImageBuildError(f"Dockerfile:{line}: {pattern!r} not found in the build context {context}")
    root = context.resolve()
    for rel in found:
        real = (context / rel).resolve()
        if real != root and root not in real.parents:
            raise ImageBuildError(f"Dockerfile:{line}: {rel!r} points outside the build context")
    return found


def _finalize(image: Image, rootfs: Path, work: Path) -> None:
    """Make the image usable read-only: WORKDIR → /workspace (files kept as the seed), Harbor's dirs → /tmp."""
    _strip_setid(rootfs)
    wd = image.workdir
    parts = Path(wd).parts[1:]
    if wd in SYSTEM_DIRS or resolve(rootfs, wd) != wd or not rootfs.joinpath(*parts).is_dir():
        image.notes.append(f"WORKDIR {wd} stays read-only in the sandbox (a system directory or a symlink); "
                           "the agent writes in /workspace and /tmp")
    else:
        target = rootfs.joinpath(*parts)
        (work / "workdir").mkdir()
        for entry in list(target.iterdir()):
            entry.rename(work / "workdir" / entry.name)
        target.rmdir()
        target.symlink_to("/workspace")
        image.writable_workdir = True
    for name in HARBOR_DIRS:
        if not os.path.lexists(rootfs / name):
            (rootfs / name).symlink_to(f"{HARBOR_ROOT}/{name}")
        else:
            image.notes.append(f"/{name} exists in the image and is read-only in the sandbox")


def _strip_setid(rootfs: Path) -> None:
    """No setuid or setgid file in an image: its root is the host's uid 0 (build_step.py), a sandbox never
    honours the bits (no_new_privs), and on the host they would make a tenant's program run as root."""
    for dirpath, _dirs, files in os.walk(rootfs):
        for name in files:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(path, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))


def _apptainer(image: Image, work: Path, log) -> None:
    exports = "\n".join(f"    export {k}={shlex.quote(v)}" for k, v in image.env.items())
    (work / "Apptainer.def").write_text(
        f"# rolloutd image {image.key} (from {image.base}); build: apptainer build image.sif Apptainer.def\n"
        f"Bootstrap: localimage\nFrom: {work.parent / image.key / 'rootfs'}\n\n"
        f"%environment\n{exports}\n\n%runscript\n    cd {shlex.quote(image.workdir)} && exec \"$@\"\n")
    binary = shutil.which("apptainer") or shutil.which("singularity")
    if binary is None:
        image.notes.append("apptainer: no .sif built (neither apptainer nor singularity is installed); "
                           "Apptainer.def is written")
        return
    try:
        from spython.main import Client  # noqa: PLC0415 - only where apptainer exists
    except ImportError:
        image.notes.append("apptainer: no .sif built (spython is not installed: pip install spython)")
        return
    log(f"building {work / 'image.sif'} with {binary}")
    Client.build(recipe=str(work / "rootfs"), image=str(work / "image.sif"), sandbox=False, sudo=False, quiet=True)


__all__ = ["DockerfileError", "Image", "ImageBuildError", "build_image", "find_dockerfile", "image_key", "load_image"]
