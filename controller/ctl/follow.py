"""`rolloutctl watch`'s loop (a live table on a terminal, one flushed line per change elsewhere: a Slurm log, a
pipe) and `delete --export`'s writer. Called by `app.py`; what they print is built in `views.py`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from rolloutd.client import RolloutClient
from rolloutd.crds.names import TERMINAL_PHASES

from . import views


def _exit_code(obj: dict[str, Any]) -> int | None:
    """0 Succeeded, 1 another end, None while the job runs."""
    phase = obj.get("status", {}).get("phase")
    return (0 if phase == "Succeeded" else 1) if phase in TERMINAL_PHASES else None


def follow_job(client: RolloutClient, obj: dict[str, Any], deadline: float, out: Console) -> int:
    """Watch the job from `obj` (its state now) until it ends: 0 Succeeded, 1 otherwise or deleted, 3 timed out."""
    name = obj["metadata"]["name"]
    changes = client.watch(name=name, since=obj["metadata"]["resourceVersion"], timeout=deadline)
    if not out.is_terminal:
        last = views.progress_line(obj)
        print(last, flush=True)
        if (code := _exit_code(obj)) is not None:
            return code
        for type_, new, _ in changes:
            if type_ == "DELETED":
                print(f"rolloutjob/{name} deleted", flush=True)
                return 1
            if (line := views.progress_line(new)) != last:
                print(line, flush=True)
                last = line
            if (code := _exit_code(new)) is not None:
                return code
        return 3
    from rich.live import Live

    with Live(views.progress_table(obj), console=out, auto_refresh=False, transient=False) as live:
        if (code := _exit_code(obj)) is not None:
            return code
        for type_, new, _ in changes:
            if type_ == "DELETED":
                return 1
            live.update(views.progress_table(new), refresh=True)
            if (code := _exit_code(new)) is not None:
                return code
    return 3


def export_jsonl(client: RolloutClient, name: str, path: Path) -> int:
    """Every trajectory of the job into `path`, one JSON line each; how many."""
    n = 0
    with open(path, "w") as f:
        for t in client.trajectories(name):
            f.write(json.dumps(t, separators=(",", ":")) + "\n")
            n += 1
    return n
