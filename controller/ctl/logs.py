"""`rolloutctl logs NAME [--node K] [--tail N] [-f]`: the node daemons' logs of a job, from the controller.

Registered on rolloutctl's app by `app.py` (`register`); reads `GET …/rolloutjobs/{name}/logs` (`http/logs.py`)
through the trainer client, so it works from any machine that reaches the controller, whichever executor (local,
Slurm, Kubernetes) runs the daemons. Lines are printed as they come, never parsed as rich markup.
Next step: `--since` (a time), as kubectl logs has.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import typer


def register(app: typer.Typer, client: Callable[[], Any], run: Callable[[Callable[[], Any]], Any]) -> None:
    """Add the `logs` command to rolloutctl's `app` (`client` and `run` are app.py's)."""

    @app.command()
    def logs(name: str = typer.Argument(..., help="the RolloutJob"),
             node: Optional[int] = typer.Option(None, "--node", min=0,
                                                help="one node daemon: the local slot, the Kubernetes index, or the "
                                                     "node's index in each Slurm allocation (default: all)"),
             tail: int = typer.Option(200, "--tail", min=0, max=10_000, help="lines per node to start with"),
             follow: bool = typer.Option(False, "-f", "--follow", help="print new lines until the job ends")) -> None:
        """Print the node daemons' logs of a job (prefixed [nodeK] when several)."""
        c = client()

        def go() -> None:
            for line in c.logs(name, node=node, tail=tail, follow=follow):
                sys.stdout.write(line + "\n")
                if follow:
                    sys.stdout.flush()
        run(go)
