"""`rolloutd sandbox ...`: debugging entry points for the sandbox runtimes."""
from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Sandbox tools."""
