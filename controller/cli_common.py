"""What every rolloutd command line shares: plain help text (no rich markup, which ate `[default: …]`),
shell completion, `--version`, and kubectl's `-n NS` anywhere on the line.

Used by `main.py` (`rolloutd`), `ctl/app.py` (`rolloutctl`) and the parts' sub-command groups.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import os
import sys

import typer
from typer.core import TyperGroup

TYPER_SETTINGS = {"rich_markup_mode": None, "add_completion": True}


def installed_version() -> str:
    try:
        return version("rolloutd")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(installed_version())
        raise typer.Exit()


def reader_gone() -> typer.Exit:
    """Standard output's reader went away (`… | head`): stop quietly with the shell's status for SIGPIPE, as
    coreutils do, instead of a traceback; stdout goes to /dev/null so that the exit's flush cannot fail again."""
    fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, sys.stdout.fileno())
    os.close(fd)
    return typer.Exit(141)


def version_option() -> bool:
    """An eager `--version` for an app's callback."""
    return typer.Option(False, "--version", callback=_print_version, is_eager=True,
                        help="print the version and exit")


_NAMESPACE_FLAGS = ("-n", "--namespace")


def hoist_namespace(args: list[str]) -> list[str]:
    """`-n NS` / `--namespace[=]NS` wherever it stands (kubectl takes it after the verb too), moved in front
    of the verb where the global option parses it; nothing after `--` moves."""
    front: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest.extend(args[i:])
            break
        if arg in _NAMESPACE_FLAGS:
            front.extend(args[i:i + 2])
            i += 2
            continue
        if arg.startswith("--namespace=") or (arg.startswith("-n") and not arg.startswith("--") and len(arg) > 2):
            front.append(arg)
        else:
            rest.append(arg)
        i += 1
    return front + rest


class NamespaceAnywhere(TyperGroup):
    """rolloutctl's command group: `-n NS` is taken before or after the verb."""

    def parse_args(self, ctx, args):  # noqa: ANN001 - click's signature
        return super().parse_args(ctx, hoist_namespace(args))
