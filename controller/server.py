"""Runs the controller process: store + API + scheduler + reconcile loop under one uvicorn server.

Called by `rolloutd controller`. The data dir holds the SQLite database (`rolloutd.db`), the
API token (`token`) and the node join token (`join-token`), both 0600, the node daemons' logs
(`logs/`) and the local executor's record of the daemons it started. All of it survives
restarts: stop the controller at any point, start it again, and every job, lease and result
is where it was (local daemons keep running and are adopted).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import uvicorn

from .api import create_app
from .auth import ensure_token
from .config import DEFAULT_HOST, DEFAULT_PORT, default_data_dir  # noqa: F401 (re-exported)
from .executors.local import LocalExecutor
from .executors.slurm import SlurmExecutor, advertised_url
from .reconciler import Reconciler
from .work.scheduler import Scheduler
from .store import Store

DB_FILE = "rolloutd.db"


EXECUTOR_KINDS = ("local", "slurm")


def build_app(data_dir: Path, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, resync: float = 2.0,
              node_grace_seconds: float = 30.0, executors: tuple[str, ...] = EXECUTOR_KINDS):
    data_dir.mkdir(parents=True, exist_ok=True)
    token = ensure_token(data_dir)
    join_token = ensure_token(data_dir, "join-token")
    store = Store(data_dir / DB_FILE)
    scheduler = Scheduler(store)
    app = create_app(store, token, join_token=join_token, scheduler=scheduler)
    reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    local = LocalExecutor(f"http://{reach}:{port}", join_token, data_dir, grace_seconds=node_grace_seconds)
    executors_by_kind = {"local": local}
    if "slurm" in executors:  # sbatch/squeue/scancel, obeying $SLURM_CONF; daemons reach $ROLLOUTD_ADVERTISE_URL
        executors_by_kind["slurm"] = SlurmExecutor(
            advertised_url(host, port), join_token, data_dir, scheduler=scheduler,
            event=lambda job, reason, msg, type_: store.add_event(job, reason, msg, type_))
    enabled = {k: v for k, v in executors_by_kind.items() if k in executors}
    reconciler = Reconciler(store, enabled, scheduler, resync=resync)
    scheduler.on_idle = reconciler.nudge  # a finished job is marked Succeeded now, not at the next resync
    app.state.reconciler, app.state.scheduler, app.state.executors = reconciler, scheduler, enabled

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        tasks = [asyncio.create_task(reconciler.run(), name="reconciler"),
                 asyncio.create_task(scheduler.run(), name="scheduler")]
        try:
            yield
        finally:
            reconciler.stop()
            scheduler.stop()
            for ex in executors_by_kind.values():
                await ex.shutdown()
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    app.router.lifespan_context = lifespan
    return app


def run_controller(data_dir: Path, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                   log_level: str = "info", executors: tuple[str, ...] = EXECUTOR_KINDS) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(data_dir, host=host, port=port, executors=executors)
    logging.getLogger("rolloutd").info("data dir %s; token file %s", data_dir, data_dir / "token")
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False,
                timeout_graceful_shutdown=5)
