"""`rolloutctl inflight NAME [--stalled-after S] [--limit N] [-o json]`: a job's rollouts in flight right now.

Registered on rolloutctl's app by `app.py` (`register`); reads `GET …/rolloutjobs/{name}/inflight`
(`http/inflight.py`). One line per rollout, stalled ones first and marked `STALLED` (`work/inflight.py` says
what that means); laid out as `get` lays out jobs (each column as wide as its widest cell).
Next step: `--watch`, refreshed every few seconds.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Optional

import typer

COLUMNS = ("ATTEMPT", "STAGE", "TURN", "IN-STAGE", "LAST-BEAT", "NODE", "BACKEND", "TRY", "STALLED")


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def inflight_table(doc: dict[str, Any]) -> str:
    """The rows of `GET …/inflight` as a table, with a summary line above it."""
    stages = ", ".join(f"{n} {stage}" for stage, n in doc["stages"].items() if n)
    head = (f"{doc['total']} in flight ({stages or 'none'}), {doc['stalled']} stalled "
            f"(in one stage or unheard for {doc['stalledAfterSeconds']:g}s or more)")
    if doc.get("truncated"):
        head += f"; the first {len(doc['items'])} shown"
    rows = [list(COLUMNS)]
    for r in doc["items"]:
        rows.append([r["attemptId"], r["stage"], "-" if r["turn"] is None else str(r["turn"]),
                     _age(r["inStageSeconds"]), _age(r["sinceHeartbeatSeconds"]) + " ago", r["node"],
                     r["backend"] or "-", str(r["attempt"] or "-"), "STALLED" if r["stalled"] else ""])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    table = "\n".join("   ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)
    return head + ("\n" + table if doc["items"] else "")


def register(app: typer.Typer, client: Callable[[], Any], run: Callable[[Callable[[], Any]], Any]) -> None:
    """Add the `inflight` command to rolloutctl's `app` (`client` and `run` are app.py's)."""

    @app.command()
    def inflight(name: str = typer.Argument(..., help="the RolloutJob"),
                 stalled_after: Optional[float] = typer.Option(
                     None, "--stalled-after", min=0, help="seconds in one stage (or unheard) that make a rollout "
                                                          "stalled (default: the controller's)"),
                 limit: Optional[int] = typer.Option(None, "--limit", min=1, max=5000, help="rows at most"),
                 output: str = typer.Option("table", "-o", "--output", help="table or json")) -> None:
        """The job's rollouts in flight: stage, turn, time in stage, last heartbeat, node, backend; stalled marked."""
        if output not in ("table", "json"):
            raise typer.BadParameter(f"{output!r}: expected table or json", param_hint="'-o'")
        c = client()
        doc = run(lambda: c.inflight(name, stalled_after, limit))
        print(json.dumps(doc, indent=2) if output == "json" else inflight_table(doc))
