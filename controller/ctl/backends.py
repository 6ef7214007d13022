"""`rolloutctl backends list|add|remove NAME [URL]`: a running job's LLM backends, listed, added or removed.

Registered on rolloutctl's app by `app.py` (`register`) as the `backends` group; reads and writes
`…/rolloutjobs/{name}/backends` (`http/trainer.py`) through the trainer client; the table is `views.print_backends`.
"""
from __future__ import annotations

from typing import Any, Callable

import typer

from . import views


def register(app: typer.Typer, client: Callable[[], Any], run: Callable[[Callable[[], Any]], Any]) -> None:
    """Add the `backends` group to rolloutctl's `app` (`client` and `run` are app.py's)."""
    backends_app = typer.Typer(help="List, add or remove a job's LLM backends while it runs.", no_args_is_help=True,
                               rich_markup_mode=None)
    app.add_typer(backends_app, name="backends")

    @backends_app.command("list")
    def backends_list(name: str = typer.Argument(..., help="the RolloutJob")) -> None:
        """The job's backends with health and in-flight tasks."""
        c = client()
        views.print_backends(run(lambda: c.backends(name)))

    @backends_app.command("add")
    def backends_add(name: str = typer.Argument(...), url: str = typer.Argument(...)) -> None:
        """Add a backend (the job's spec is updated; new tasks may be pinned to it at once)."""
        c = client()
        views.print_backends(run(lambda: c.add_backend(name, url)))

    @backends_app.command("remove")
    def backends_remove(name: str = typer.Argument(...), url: str = typer.Argument(...)) -> None:
        """Remove a backend: tasks not yet running move elsewhere; running ones finish on it."""
        c = client()
        views.print_backends(run(lambda: c.remove_backend(name, url)))
