"""The rolloutd container image (charts/image/Containerfile), built with Debian's podman and no registry pulls.

Where it sits: `make image` and tests/image/test_image.py call `build()`; the Helm chart (charts/rolloutd) runs
the result. The base is a Debian bookworm minbase made by mmdebstrap (the suite and mirrors of the sandbox's
root filesystems, sandbox/image/rootfs.py) and imported with `podman import`; Python packages come from a wheelhouse
(`wheelhouse()`, shared with tests/test_distribution.py) and the rolloutd wheel built from this tree, installed
with --no-index in a build without network. The image is tagged `rolloutd:<key>`, the key a hash of what goes
in (the Containerfile, the wheel's content, the wheelhouse's key, the base's parameters): a second build with
nothing changed finds it in podman's store and only tags it. Next step: `podman push` it to a registry.

    python charts/image/build.py [--tag rolloutd:0.1.0]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from pathlib import Path

from rolloutd.sandbox.image.rootfs import SOURCES, SUITE, locked

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = Path(__file__).resolve().parent / "Containerfile"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
VERSION = PROJECT["version"]
DEFAULT_TAG = f"rolloutd:{VERSION}"  # the Helm chart's default image (tests/charts/test_chart.py)
# the image installs rolloutd[controller,kubernetes]; the wheelhouse holds every extra's dependencies but trl's
WHEEL_EXTRAS = ("node", "controller", "kubernetes")
BASE_PACKAGES = ("python3", "python3-venv", "bubblewrap", "python3-seccomp", "ca-certificates")
# no documentation, manual pages or translations in the base (mmdebstrap's documented --dpkgopt idiom)
BASE_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/locale/*", "/usr/share/info/*")


def cache_home() -> Path:
    return Path(os.environ.get("ROLLOUTD_HOME", Path.home() / ".cache" / "rolloutd"))


def wheelhouse() -> Path:
    """Wheels of every dependency of the base install and of WHEEL_EXTRAS, downloaded once into
    `~/.cache/rolloutd/wheelhouse/<hash of the requirements>` (the key changes when a requirement does)."""
    optional = PROJECT["optional-dependencies"]
    reqs = [r for r in PROJECT["dependencies"] + [r for e in WHEEL_EXTRAS for r in optional[e]]
            if not r.startswith("rolloutd[")]
    key = hashlib.sha256("\n".join(PROJECT["dependencies"] + [str(optional), *WHEEL_EXTRAS]).encode())
    house = cache_home() / "wheelhouse" / key.hexdigest()[:16]
    if not (house / ".complete").exists():
        with locked(house):
            if not (house / ".complete").exists():
                house.mkdir(parents=True, exist_ok=True)
                subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "-w", str(house), *reqs],
                               check=True, timeout=900)
                (house / ".complete").write_text("\n".join(sorted(reqs)))
    return house


def build_wheel(out: Path) -> Path:
    """The rolloutd wheel of this tree, written into `out`."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)],
                   check=True, timeout=300)
    return next(out.glob("rolloutd-*.whl"))


def wheel_digest(wheel: Path) -> str:
    """A hash of the wheel's files (names and bytes), not of the zip: rebuilding the same tree gives the same."""
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            h.update(name.encode() + b"\0" + hashlib.sha256(z.read(name)).digest())
    return h.hexdigest()


def base_params() -> dict:
    return {"suite": SUITE, "variant": "minbase", "packages": list(BASE_PACKAGES), "sources": list(SOURCES),
            "excludes": list(BASE_EXCLUDES), "format": 1}


def _key(params: object) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]


def host_options() -> list[str]:
    """podman's global options this host needs. crun refuses a hybrid cgroup hierarchy (v1 controllers with a
    v2 one that still has controllers, as on some VMs): runc (Debian's) runs there."""
    unified = Path("/sys/fs/cgroup/unified/cgroup.controllers")
    hybrid = unified.is_file() and unified.read_text().strip()
    return ["--runtime", "runc"] if hybrid and shutil.which("runc") else []


def limit_options() -> list[str]:
    """`--ulimit`s for podman build/run: podman's defaults for root raise the open-file and process limits
    above this process's, which needs CAP_SYS_RESOURCE (a VM's root may not hold it); keep them at most ours."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # processes: at most 32768 (on the VM this was made on, runc refused 49152 and more although the hard limit
    # was 96365; the reason was not found)
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)
    return ["--ulimit", f"nofile={soft}:{hard}", "--ulimit", f"nproc={nproc}:{nproc}"]


def podman(*args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    if not shutil.which("podman"):
        raise RuntimeError("podman is not installed: bash .ci/system-packages.sh (apt-get install podman buildah)")
    return subprocess.run(["podman", *host_options(), *args], check=check, **kw)


def exists(ref: str) -> bool:
    return podman("image", "exists", ref, check=False).returncode == 0


def base_image(log=print) -> str:
    """`localhost/rolloutd-base:<key of base_params()>`, made once: mmdebstrap's tarball piped to podman import."""
    ref = f"localhost/rolloutd-base:{_key(base_params())}"
    if exists(ref):
        return ref
    mode = "root" if os.geteuid() == 0 else "unshare"
    argv = ["mmdebstrap", f"--mode={mode}", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
            *[f"--dpkgopt=path-exclude={p}" for p in BASE_EXCLUDES], "--format=tar", SUITE, "-", *SOURCES]
    log(f"making the {SUITE} base with mmdebstrap ({', '.join(BASE_PACKAGES)})")
    with tempfile.TemporaryFile() as tar:
        done = subprocess.run(argv, stdout=tar, stderr=subprocess.PIPE, text=False, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"mmdebstrap failed ({done.returncode}): {done.stderr.decode()[-2000:]}")
        tar.seek(0)
        podman("import", "--quiet", "-", ref, stdin=tar, stdout=subprocess.DEVNULL)
    return ref


def build(tags: tuple[str, ...] = (), log=print) -> str:
    """The image's reference (`localhost/rolloutd:<key>`), built unless podman's store has it, also tagged `tags`."""
    house = wheelhouse()
    with tempfile.TemporaryDirectory(prefix="rolloutd-image-") as tmp:
        wheels = Path(tmp) / "wheels"
        wheels.mkdir()
        wheel = build_wheel(wheels)
        key = _key({"containerfile": CONTAINERFILE.read_text(), "wheel": wheel_digest(wheel),
                    "wheelhouse": house.name, "base": base_params()})
        ref = f"localhost/rolloutd:{key}"
        with locked(cache_home() / "image" / "build"):
            if not exists(ref):
                base = base_image(log)
                for w in house.glob("*.whl"):
                    shutil.copy(w, wheels / w.name)
                log(f"building {ref} from {base}")
                podman("build", "--quiet", "--pull=never", "--network=none", *limit_options(), "-f", str(CONTAINERFILE),
                       "--build-arg", f"BASE={base}", "-t", ref, tmp, stdout=subprocess.DEVNULL)
                prune(keep=ref)
    for tag in tags:
        podman("tag", ref, tag)
    return ref


def prune(keep: str) -> None:
    """Remove the images of earlier trees (named only `localhost/rolloutd:<key>`, not `keep`): each is ~600 MB of
    its own, and every change of the tree makes a new one. An image with any other name (the base, a release tag
    such as rolloutd:0.1.0) stays; podman refuses to remove one another image is built on."""
    listed = podman("images", "--format", "{{.ID}} {{.Repository}}:{{.Tag}}", check=False, capture_output=True,
                    text=True)
    names: dict[str, set[str]] = {}
    for line in listed.stdout.splitlines():
        image_id, _, name = line.strip().partition(" ")
        if image_id:
            names.setdefault(image_id, set()).add(name)
    prefix, key = keep.rsplit(":", 1)
    for image_id, refs in names.items():
        if keep in refs:
            continue
        if all(r.rsplit(":", 1)[0] == prefix and len(r.rsplit(":", 1)[1]) == len(key) for r in refs):
            podman("rmi", image_id, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the rolloutd image with podman (no registry pulls).")
    parser.add_argument("--tag", action="append", default=None,
                        help=f"also tag it so (default: {DEFAULT_TAG}, the chart's default image)")
    args = parser.parse_args()
    t0 = time.monotonic()
    ref = build(tuple(args.tag or [DEFAULT_TAG]), log=lambda m: print(m, file=sys.stderr))
    print(f"{ref} ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    print(ref)


if __name__ == "__main__":
    main()
