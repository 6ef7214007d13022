"""Where rolloutd keeps things: `$ROLLOUTD_HOME` (what every clone on a machine shares, its models directory)
and the controller's data directory.

Shared by the node side (agents/engine_venv.py installs there, agents/model_dirs.py builds models there)
and the controller (controller/config.py lets tokenizers come from the models directory).
"""
from __future__ import annotations

import os
from pathlib import Path

from .settings import env


def rolloutd_home() -> Path:
    """`$ROLLOUTD_HOME`, default `~/.cache/rolloutd`: shared by every clone on the machine."""
    return Path(env("ROLLOUTD_HOME") or Path.home() / ".cache" / "rolloutd")


def default_data_dir() -> Path:
    """The controller's data directory: `$ROLLOUTD_DATA_DIR`, else `$XDG_DATA_HOME/rolloutd`
    (~/.local/share/rolloutd). The one rule: the controller keeps its state there, the sandbox hides it."""
    data = env("ROLLOUTD_DATA_DIR")
    return Path(data) if data else xdg_data_dir()


def xdg_data_dir(home: Path | None = None) -> Path:
    """`$XDG_DATA_HOME/rolloutd`, else `<home>/.local/share/rolloutd`: the data directory's default."""
    return Path(os.environ.get("XDG_DATA_HOME") or (home or Path.home()) / ".local" / "share") / "rolloutd"


def models_dir(home: Path | None = None) -> Path:
    """The models rolloutd builds (`tiny`, `smollm2`) live here, one directory each."""
    return (home or rolloutd_home()) / "models"
