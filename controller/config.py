"""Defaults shared by the controller and its clients (kept import-light for the CLI)."""
from __future__ import annotations

import os
from pathlib import Path

API_PREFIX = "/apis/rolloutd.io/v1alpha1"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7350


def default_data_dir() -> Path:
    """`$ROLLOUTD_DATA_DIR`, else `$XDG_DATA_HOME/rolloutd` (~/.local/share/rolloutd)."""
    if env := os.environ.get("ROLLOUTD_DATA_DIR"):
        return Path(env)
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return base / "rolloutd"
