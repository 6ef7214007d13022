"""Sub-commands the node side contributes to `rolloutd` (serve-model, later node)."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Attach the agents' commands to the `rolloutd` app."""
