"""`rolloutd sandbox ...`: debugging entry points for the sandbox runtimes.

Where it sits: the ``sandbox`` sub-command of ``rolloutd`` (``register``, a ``rolloutd.commands``
entry point). ``rolloutd sandbox exec -- COMMAND`` runs one bash
command through the full production path (runtime → execution server → pty)
and exits with the command's exit code: the way to check an image or a limit
by hand, e.g.::

    rolloutd sandbox exec --memory-mb 256 -- python3 -c 'x = bytearray(10**9)'
    rolloutd sandbox exec --image /srv/rootfs/bookworm -- cat /etc/os-release
"""
from __future__ import annotations

import asyncio
import shlex
import sys
from typing import List, Optional, get_args

import typer

from ..crds.rolloutjob import RuntimeKind

app = typer.Typer(no_args_is_help=True, rich_markup_mode=None)
OPTIONS = {"runtime": "--runtime", "image": "--image", "network": "--network", "limits.memory_mb": "--memory-mb",
           "limits.processes": "--processes"}  # a SandboxSpec field → the option that sets it


@app.callback()
def _group() -> None:
    """Sandbox tools."""


@app.command(
    "exec",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def exec_(
    command: List[str] = typer.Argument(..., help="the bash command (put it after --)"),
    runtime: str = typer.Option("bwrap", "--runtime", help=" | ".join(get_args(RuntimeKind))),
    image: str = typer.Option("host", "--image", help="host, a root filesystem directory, or a .sif"),
    network: bool = typer.Option(False, "--network", help="give the sandbox the host's network"),
    memory_mb: Optional[int] = typer.Option(None, "--memory-mb", help="memory limit (MB)"),
    processes: Optional[int] = typer.Option(None, "--processes", help="process limit"),
    timeout: float = typer.Option(60.0, "--timeout", help="command timeout (s); Ctrl-C, then kill"),
) -> None:
    """Run one bash command in a fresh sandbox; print its output; exit with its exit code."""
    from pydantic import ValidationError

    from ..crds.rolloutjob import SandboxSpec
    from ..crds.kit.settings import SandboxSettings, SettingsError
    from .errors import ExecError, SandboxError

    limits = {}
    if memory_mb is not None:
        limits["memory_mb"] = memory_mb
    if processes is not None:
        limits["processes"] = processes
    try:
        settings = SandboxSettings.from_env()  # this command's entry point: the variables are read here, once
        spec = SandboxSpec(runtime=runtime, image=image, network=network, limits=limits)
    except ValidationError as e:  # each error as the option it came from, not pydantic's path and help link
        for error in e.errors():
            field = ".".join(str(p) for p in error["loc"])
            typer.echo(f"rolloutd sandbox exec: {OPTIONS.get(field, field)}: {error['msg']}", err=True)
        raise typer.Exit(2) from None
    except (SettingsError, ValueError) as e:
        typer.echo(f"rolloutd sandbox exec: {e}", err=True)
        raise typer.Exit(2) from None
    text = command[0] if len(command) == 1 else shlex.join(command)
    try:
        code = asyncio.run(_run(spec, settings, text, timeout))
    except (SandboxError, ExecError) as e:
        typer.echo(f"rolloutd sandbox exec: {type(e).__name__}: {e}", err=True)
        raise typer.Exit(125) from None
    raise typer.Exit(code)


async def _run(spec, settings, command: str, timeout: float) -> int:
    from .runtimes import create_sandbox

    sandbox = await create_sandbox(spec, settings)
    try:
        result = await sandbox.bash(command, timeout=timeout, max_output=1 << 20)
    finally:
        await sandbox.close()
    sys.stdout.write(result.output)
    if result.output and not result.output.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    if result.timed_out:
        typer.echo(f"rolloutd sandbox exec: timed out after {timeout:g}s", err=True)
        return 124
    return result.exit_code if result.exit_code is not None else 125


def register(root: typer.Typer) -> None:
    """Attach `rolloutd sandbox …` and `rolloutd image …` (the `rolloutd.commands` entry point)."""
    from .image.cli import app as image_app

    root.add_typer(app, name="sandbox", help="Run commands in a sandbox by hand (debugging).")
    root.add_typer(image_app, name="image",
                   help="Build root filesystem images from Dockerfiles (rolloutd image build DIR).")
