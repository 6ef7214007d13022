"""`rolloutctl trajectories NAME`: a job's results as a table (SEQ … TURNS … REASON), JSON lines or one JSON
array, filtered by outcome, prompt and reward; `-f` follows them until the job ends, through controller restarts.

Registered on rolloutctl's app by `app.py` (`register`); rows come from the trainer client, lines from
`views.py`. Next step: the decoded single trajectory (`trajectory.py`).
"""
from __future__ import annotations

import json
import sys
from typing import Any, Callable, Optional

import typer

from . import views

FAILURE_OF = {"scored": "none", "agent-failed": "agent", "infra-failed": "infra", "config": "config"}


def keep(t: dict[str, Any], outcome: str | None, prompt: int | None, min_reward: float | None) -> bool:
    """Whether trajectory `t` passes the filters (None: no filter)."""
    if outcome is not None and (t.get("failure") or {}).get("kind", "none") != FAILURE_OF[outcome]:
        return False
    if prompt is not None and t.get("prompt") != prompt:
        return False
    return min_reward is None or (t.get("reward") is not None and t["reward"] >= min_reward)


def register(app: typer.Typer, client: Callable[[float], Any], run: Callable, fail: Callable,
             follow_retry: float) -> None:
    @app.command()
    def trajectories(
        name: str = typer.Argument(..., help="the RolloutJob"),
        output: str = typer.Option("table", "-o", "--output", help="table|jsonl|json"),
        follow: bool = typer.Option(False, "-f", "--follow", help="stream new ones until the job ends"),
        cursor: int = typer.Option(0, "--cursor", help="start after this seq (resume)"),
        outcome: Optional[str] = typer.Option(None, "--outcome",
                                              help=f"only these: {' | '.join(FAILURE_OF)}"),
        prompt: Optional[int] = typer.Option(None, "--prompt", help="only this dataset index's samples"),
        min_reward: Optional[float] = typer.Option(None, "--min-reward", help="only rewards at least this"),
    ) -> None:
        """Print a job's trajectories (a table for people, JSON lines or a JSON array for programs)."""
        if output not in ("jsonl", "json", "table"):
            raise fail(f"unknown output format {output!r} (table, jsonl, json)", 2)
        if outcome is not None and outcome not in FAILURE_OF:
            raise fail(f"unknown outcome {outcome!r} ({', '.join(FAILURE_OF)})", 2)
        if output == "json" and follow:
            raise fail("-o json prints one array at the end: use -o jsonl with --follow", 2)
        rc = client(follow_retry if follow else 0.0)

        def go() -> None:
            rows: list[Any] = []
            if output == "table":
                print(views.TRAJECTORY_HEADER, flush=follow)
            for t in rc.trajectories(name, cursor=cursor, follow=follow):
                if not keep(t, outcome, prompt, min_reward):
                    continue
                if output == "jsonl":
                    sys.stdout.write(json.dumps(t, separators=(",", ":")) + "\n")
                    sys.stdout.flush()
                elif output == "json":
                    rows.append(t)
                else:
                    print(views.trajectory_line(t), flush=follow)
            if output == "json":
                print(json.dumps(rows, indent=1))

        run(go)
