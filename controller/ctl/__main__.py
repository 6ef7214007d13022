"""`python -m rolloutd.controller.ctl`: the full typer app (`app.py`) on every call, without the `rolloutctl`
command's fast path (`entry.py`); the tests and `bench/bench_cli.py` compare the two. Next step: `app.py`."""
from __future__ import annotations

from .app import app

if __name__ == "__main__":
    app()
