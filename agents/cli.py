"""Sub-commands the node side contributes to `rolloutd` (serve-model, node).

Where it sits: `register(app)` is a `rolloutd.commands` entry point that `rolloutd`'s main loads. `serve-model` drives
agents/engine/server.py (engine venv + vLLM server) and agents/engine/model_dirs.py (model directories); `node` runs
the node daemon (agents/daemon/daemon.py), as Slurm's srun or the controller's local executor start it.
"""
from __future__ import annotations

import signal
import sys
import time
from typing import Optional

import typer

from rolloutd.crds.kit import tracing


def register(app: typer.Typer) -> None:
    """Attach the agents' commands to the `rolloutd` app."""
    app.command("serve-model")(serve_model)
    app.command("node")(node)


def node(
    controller: Optional[str] = typer.Option(
        None, "--controller", help="Controller URL (default: $ROLLOUTD_CONTROLLER).", show_default=False,
    ),
    job: Optional[str] = typer.Option(None, "--job", help="RolloutJob name (default: $ROLLOUTD_JOB).", show_default=False),
    name: Optional[str] = typer.Option(
        None, "--name", help="Node name (default: $SLURMD_NODENAME, else the hostname).", show_default=False,
    ),
    slot: Optional[int] = typer.Option(None, "--slot", help="Executor slot this daemon fills (local executor)."),
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error."),
    restarts: int = typer.Option(
        0, "--restarts", min=0,
        help="Run the daemon as a child and start it again when it crashes, at most N times in 10 minutes "
             "(the Slurm executor's batch script uses 5). Exit 0 and refusals (exit 2) are final.",
    ),
) -> None:
    """Run a node daemon: register, lease rollouts, run INIT/RUN/EVAL, report (until the job is done).

    The job's node credential is read from $ROLLOUTD_JOIN_TOKEN only (never from the command line, which
    other users of a shared node can read). SIGTERM: hand back unstarted work, drain for
    $ROLLOUTD_DRAIN_SECONDS (default 30), exit 0. Exit 2: refused by the controller or misconfigured.
    """
    if restarts:
        from .daemon.supervise import supervise

        argv = [sys.executable, "-m", "rolloutd.agents.daemon", "--log-level", log_level]  # the daemon's own module
        for flag, value in (("--controller", controller), ("--job", job), ("--name", name), ("--slot", slot)):
            if value is not None:
                argv += [flag, str(value)]
        raise typer.Exit(supervise(argv, restarts))

    import asyncio
    import logging

    from .daemon.daemon import run_node
    from .daemon.options import NodeError, NodeOptions

    try:
        options = NodeOptions.from_env(controller=controller, job=job, name=name, slot=slot)
    except NodeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    logging.basicConfig(
        stream=sys.stderr, level=getattr(logging, log_level.upper(), logging.INFO),
        format=f"%(asctime)s rolloutd-node {options.name} %(levelname)s %(name)s: %(message)s",
    )
    tracing.setup("rolloutd-node", options.tracing)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is too much
    code = asyncio.run(run_node(options))
    tracing.flush()
    raise typer.Exit(code)


def serve_model(
    model: Optional[list[str]] = typer.Option(
        None, "--model", "-m",
        help="smollm2, tiny or a Hugging Face directory (default smollm2). Repeat with --prepare-only.",
    ),
    host: str = typer.Option("127.0.0.1", help="Bind address. Dev-mode endpoints are on: keep it local."),
    port: int = typer.Option(8000, help="Port (0 = any free port)."),
    dtype: Optional[str] = typer.Option(None, help="vLLM --dtype (default: the engine's choice)."),
    max_model_len: Optional[int] = typer.Option(None, help="vLLM --max-model-len."),
    prepare_only: bool = typer.Option(
        False, "--prepare-only", help="Install the engine venv and prepare the model(s), then exit.",
    ),
) -> None:
    """Install the vLLM engine (once), prepare the model, serve it until SIGINT/SIGTERM."""
    from .engine.server import EngineServer
    from .engine.venv import EngineEnv, EngineError
    from .engine.model_dirs import prepare_model

    names = model or ["smollm2"]
    engine = EngineEnv()
    try:
        if prepare_only:
            if not engine.installed():
                typer.echo(f"installing the engine venv in {engine.venv} (once; a few minutes)", err=True)
            engine.install()
            for name in names:
                typer.echo(f"{name}: {prepare_model(name, engine)}")
            return
        if len(names) != 1:
            raise typer.BadParameter("serve one model at a time (several only with --prepare-only)")
        server = EngineServer(names[0], host=host, port=port, dtype=dtype, max_model_len=max_model_len)

        def _stop(signum: int, _frame: object) -> None:
            raise KeyboardInterrupt(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        try:
            server.start(progress=lambda message: typer.echo(message, err=True))
            typer.echo(server.url, nl=True)
            sys.stdout.flush()
            typer.echo(f"ready at {server.url}: serving {server.served_name} from {server.model_dir} "
                       f"(started in {server.started_in:.1f}s; log {server.log_path})", err=True)
            while server.alive():
                time.sleep(0.5)
            raise EngineError(f"vLLM exited unexpectedly; log {server.log_path}:\n{server.log_tail()}")
        except KeyboardInterrupt:
            typer.echo("stopping the engine", err=True)
        finally:
            server.stop()
    except EngineError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
