"""The `rolloutctl` command's entry point: `--version` answered before anything is imported (a shell's prompt or
a CI step may call it often), the plain forms of `get` by `fast.py`, every other call by the typer app in
`app.py`."""
from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:] == ["--version"]:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(version("rolloutd"))
        except PackageNotFoundError:  # a source tree that was never installed
            print("unknown")
        return
    if "get" in sys.argv[1:]:
        from .fast import run

        if (code := run(sys.argv[1:])) is not None:
            sys.exit(code)
    from .app import app

    app()
