"""Where the tests find the real kubectl and helm binaries (issue 13's chart and kubectl tests).

`make kube-tools` (.ci/kube-tools.sh) installs both under $ROLLOUTD_KUBE_BIN (default
~/.cache/rolloutd/kube/bin); that directory is looked at first, then PATH. A missing binary is
an error naming the command that installs it, never a silent skip.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def kube_bin_dir() -> Path:
    return Path(os.environ.get("ROLLOUTD_KUBE_BIN") or Path.home() / ".cache" / "rolloutd" / "kube" / "bin")


def _find(name: str) -> str:
    candidate = kube_bin_dir() / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(f"{name} not found in {kube_bin_dir()} nor on PATH: run `make kube-tools`")


def kubectl() -> str:
    """Path of the kubectl binary."""
    return _find("kubectl")


def helm() -> str:
    """Path of the helm binary."""
    return _find("helm")
