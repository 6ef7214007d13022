"""Where rolloutd keeps what every clone on a machine shares: `$ROLLOUTD_HOME` and its models directory.

Shared by the node side (agents/engine_venv.py installs there, agents/model_dirs.py builds models there)
and the controller (controller/config.py lets tokenizers come from the models directory).
"""
from __future__ import annotations

import os
from pathlib import Path


def rolloutd_home() -> Path:
    """`$ROLLOUTD_HOME`, default `~/.cache/rolloutd`: shared by every clone on the machine."""
    return Path(os.environ.get("ROLLOUTD_HOME") or Path.home() / ".cache" / "rolloutd")


def models_dir(home: Path | None = None) -> Path:
    """The models rolloutd builds (`tiny`, `smollm2`) live here, one directory each."""
    return (home or rolloutd_home()) / "models"
