"""Where the tests find the real kubectl and helm binaries (issue 13's chart and kubectl tests).

`make kube-tools` (.ci/kube-tools.sh) installs both under $ROLLOUTD_KUBE_BIN (default
~/.cache/rolloutd/kube/bin). kubectl: the machine's own (PATH) first, else that one; helm: that one
first, else PATH. A missing binary is an error naming the command that installs it, never a skip.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def kube_bin_dir() -> Path:
    return Path(os.environ.get("ROLLOUTD_KUBE_BIN") or Path.home() / ".cache" / "rolloutd" / "kube" / "bin")


def _find(name: str, *, path_first: bool = False) -> str:
    candidate = kube_bin_dir() / name
    cached = str(candidate) if candidate.is_file() and os.access(candidate, os.X_OK) else None
    on_path = shutil.which(name)
    found = (on_path or cached) if path_first else (cached or on_path)
    if found:
        return found
    raise FileNotFoundError(f"{name} not found in {kube_bin_dir()} nor on PATH: run `make kube-tools`")


def kubectl() -> str:
    """Path of the kubectl binary (the machine's own when it has one)."""
    return _find("kubectl", path_first=True)


def helm() -> str:
    """Path of the helm binary."""
    return _find("helm")
