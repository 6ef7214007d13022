"""The `rolloutd` command: the daemons and operator tools.

`rolloutd controller` runs the controller; the other parts contribute their own
sub-commands (`sandbox`, `serve-model`, later `node`) from their own folders so
that each part keeps its CLI next to its code.
"""
from __future__ import annotations

import typer

from rolloutd.agents.cli import register as register_agent_commands
from rolloutd.sandbox.cli import app as sandbox_app

app = typer.Typer(
    help="rolloutd: Rollout-as-a-Service operator for Slurm (daemons and operator tools).",
    no_args_is_help=True,
    add_completion=False,
)
app.add_typer(sandbox_app, name="sandbox", help="Run commands in a sandbox by hand (debugging).")
register_agent_commands(app)


@app.command()
def version() -> None:
    """Print the version."""
    from importlib.metadata import version as _v

    typer.echo(_v("rolloutd"))


if __name__ == "__main__":  # pragma: no cover
    app()
