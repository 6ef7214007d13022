"""Where rolloutd keeps things: `$ROLLOUTD_HOME` (what every clone on a machine shares, its models directory),
the controller's data directory and every file in it (`DataDir`), and the controller's default address.

Shared by the node side (agents/engine/venv.py installs there, agents/engine/model_dirs.py builds models there),
the controller (its data dir; `controller/access/allowlists.py` lets tokenizers come from the models directory) and the
trainer client (the local controller's token file). The bottom layer: imports only `settings`, where the
variables that choose these directories are read (each process's settings object holds its own).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .settings import home_dir

DEFAULT_HOST = "127.0.0.1"  # the controller's address when none is given (the CLI, the trainer client)
DEFAULT_PORT = 7350


def rolloutd_home() -> Path:
    """`$ROLLOUTD_HOME`, default `~/.cache/rolloutd`: where `rolloutd serve-model` keeps the engine venv and models."""
    return home_dir()


def models_dir(home: Path | None = None) -> Path:
    """The models rolloutd builds (`tiny`, `smollm2`) live here, one directory each."""
    return (home or rolloutd_home()) / "models"


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
