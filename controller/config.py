"""Defaults shared by the controller and its clients: address, data dir and every file in it, the
environment's allow-lists. Kept import-light (the CLI and the trainer client import it); `server.py`
wires the controller from it. The API's prefix is `rolloutd.crds.names.API_PREFIX`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rolloutd.crds import paths
from rolloutd.crds.settings import env

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 7350


default_data_dir = paths.default_data_dir  # `$ROLLOUTD_DATA_DIR`, else ~/.local/share/rolloutd (crds/paths.py)


@dataclass(frozen=True)
class DataDir:
    """Every path in the controller's data dir, named once. All of it survives restarts."""

    root: Path

    @property
    def db(self) -> Path:
        """The SQLite database (WAL: `-wal` and `-shm` files beside it)."""
        return self.root / "rolloutd.db"

    @property
    def token(self) -> Path:
        """The API token (0600): full access; rolloutctl and the trainer client read it."""
        return self.root / "token"

    @property
    def node_credentials(self) -> Path:
        """The jobs' node credentials (0600; `nodeauth.py`): each registers nodes for its own job only."""
        return self.root / "node-credentials.json"

    @property
    def tokens(self) -> Path:
        """Scoped tokens (read-only, limited to namespaces), one JSON file each (0600): `rolloutd token create`."""
        return self.root / "tokens"

    @property
    def logs(self) -> Path:
        """The node daemons' logs, one file per daemon."""
        return self.root / "logs"

    def executor_state(self, kind: str) -> Path:
        """An executor's record of what it started (`local`: daemon pids, `slurm`: allocations)."""
        return self.root / f"{kind}-executor.json"


def backend_allow_nets() -> list:
    """`$ROLLOUTD_BACKEND_ALLOW_NETS`: comma-separated networks (e.g. 169.254.0.0/16) a backend URL's
    literal address may be in although the default policy refuses them (link-local, unspecified…)."""
    import ipaddress

    raw = (env("ROLLOUTD_BACKEND_ALLOW_NETS") or "")
    return [ipaddress.ip_network(n.strip(), strict=False) for n in raw.split(",") if n.strip()]


def tokenizer_roots() -> list[str]:
    """Directories an absolute `llm.tokenizer` may be under: `$ROLLOUTD_TOKENIZER_ROOTS` (os.pathsep-
    separated) added to rolloutd's models dir (`$ROLLOUTD_HOME/models`) and the Hugging Face cache."""
    from rolloutd.crds.paths import models_dir

    hf = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    extra = [p for p in (env("ROLLOUTD_TOKENIZER_ROOTS") or "").split(os.pathsep) if p.strip()]
    return [os.path.normpath(str(p)) for p in (models_dir(), hf, *extra)]
