"""Wires the controller process: store + API + scheduler + executors + reconcile loop, one uvicorn server.

Called by `rolloutd controller` (`main.py`). Everything lives in the data dir (`config.DataDir`
names each file) and survives restarts: stop the controller at any point, start it again, and
every job, lease and result is where it was (local daemons keep running and are adopted).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import uvicorn

from .api import create_app
from .auth import TokenBook, ensure_token
from .config import DEFAULT_HOST, DEFAULT_PORT, DataDir
from .executors.kubernetes import KubernetesExecutor
from .executors.local import LocalExecutor
from .executors.base import advertised_url
from .executors.slurm.executor import SlurmExecutor
from .reconciler import Reconciler
from .work.scheduler import Scheduler
from .store import Store

EXECUTOR_KINDS = ("local", "slurm", "kubernetes")


def build_app(data_dir: Path, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, resync: float = 2.0,
              node_grace_seconds: float = 30.0, executors: tuple[str, ...] = EXECUTOR_KINDS):
    paths = DataDir(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    token = ensure_token(paths.token)
    join_token = ensure_token(paths.join_token)
    store = Store(paths.db)
    scheduler = Scheduler(store)
    app = create_app(store, token, join_token=join_token, scheduler=scheduler, tokens=TokenBook(paths.tokens))
    reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    local = LocalExecutor(f"http://{reach}:{port}", join_token, data_dir, grace_seconds=node_grace_seconds)
    executors_by_kind = {"local": local}
    if "slurm" in executors:  # sbatch/squeue/scancel, obeying $SLURM_CONF; daemons reach $ROLLOUTD_ADVERTISE_URL
        executors_by_kind["slurm"] = SlurmExecutor(
            advertised_url(host, port), join_token, data_dir, scheduler=scheduler,
            event=lambda job, reason, msg, type_: store.add_event(job, reason, msg, type_))
    if "kubernetes" in executors:  # an Indexed Job per RolloutJob; the client ([kubernetes] extra) loads on first use
        executors_by_kind["kubernetes"] = KubernetesExecutor(advertised_url(host, port), join_token)
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
                   log_level: str = "info", executors: tuple[str, ...] = EXECUTOR_KINDS,
                   tls: tuple[Path, Path] | None = None) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(data_dir, host=host, port=port, executors=executors)
    logging.getLogger("rolloutd").info("data dir %s; token file %s", data_dir, DataDir(data_dir).token)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False,
                timeout_graceful_shutdown=5, ssl_certfile=tls and str(tls[0]), ssl_keyfile=tls and str(tls[1]))
