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


def backend_allow_nets() -> list:
    """`$ROLLOUTD_BACKEND_ALLOW_NETS`: comma-separated networks (e.g. 169.254.0.0/16) a backend URL's
    literal address may be in although the default policy refuses them (link-local, unspecified…)."""
    import ipaddress

    raw = os.environ.get("ROLLOUTD_BACKEND_ALLOW_NETS", "")
    return [ipaddress.ip_network(n.strip(), strict=False) for n in raw.split(",") if n.strip()]


def tokenizer_roots() -> list[str]:
    """Directories an absolute `llm.tokenizer` may be under: `$ROLLOUTD_TOKENIZER_ROOTS` (os.pathsep-
    separated) added to rolloutd's models dir (`$ROLLOUTD_HOME/models`) and the Hugging Face cache."""
    from rolloutd.agents.model_dirs import models_dir

    hf = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    extra = [p for p in os.environ.get("ROLLOUTD_TOKENIZER_ROOTS", "").split(os.pathsep) if p.strip()]
    return [os.path.normpath(str(p)) for p in (models_dir(), hf, *extra)]
