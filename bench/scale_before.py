"""An older revision's own `bench scale`: its controller driven by its own simulated nodes, for a side-by-side
figure when the node protocol has changed since (`$ROLLOUTD_SCALE_BEFORE` drives an older controller with today's
simulator, which a controller of node protocol 1 refuses).

    python -m bench.scale_before REV        (e.g. a1ef202, before the tenancy work; then `python -m bench.bench_scale`)

The revision's tree comes from `git archive`; its packages are made importable as `rolloutd.*` from its own
pyproject's `package-dir`, ahead of this checkout's install, and its `bench.bench_scale` runs in that tree with this
environment (`ROLLOUTD_SCALE_NODES`, `ROLLOUTD_SCALE_NICE`, `ROLLOUTD_SCALE_LABEL`…). Its JSON stays in the
temporary tree: this prints its table and the point's summary lines. Results: bench/results/RESULTS-scale.md.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def importable(tree: Path, into: Path) -> None:
    """`tree`'s packages linked under `into/rolloutd` as its pyproject maps them."""
    dirs = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    root = into / "rolloutd"
    root.mkdir(parents=True)
    (root / "__init__.py").touch()
    for package, folder in dirs.items():
        name = package.removeprefix("rolloutd.")
        if "." not in name and (tree / folder).is_dir():
            (root / name).symlink_to(tree / folder)


def main(rev: str) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="rolloutd-scale-before-"))
    try:
        tree = tmp / "tree"
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        importable(tree, tmp / "shim")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp / "shim"), str(tree)])}
        return subprocess.run([sys.executable, "-m", "bench.bench_scale"], cwd=tree, env=env).returncode
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
