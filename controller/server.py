"""Runs the controller process: store + API + reconcile loop under one uvicorn server.

Called by `rolloutd controller`. The data dir holds the SQLite database (`rolloutd.db`) and
the API token (`token`, 0600); both survive restarts, so stopping the controller at any
point and starting it again finds every job and its status where it was.
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
from .reconciler import Executor, Reconciler, WorkTracker
from .store import Store

DB_FILE = "rolloutd.db"


def build_app(data_dir: Path, executors: dict[str, Executor] | None = None,
              work: WorkTracker | None = None, resync: float = 2.0):
    token = ensure_token(data_dir)
    store = Store(data_dir / DB_FILE)
    app = create_app(store, token)
    reconciler = Reconciler(store, executors or {}, work, resync=resync)
    app.state.reconciler = reconciler

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        task = asyncio.create_task(reconciler.run(), name="reconciler")
        try:
            yield
        finally:
            reconciler.stop()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    app.router.lifespan_context = lifespan
    return app


def run_controller(data_dir: Path, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                   log_level: str = "info") -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(data_dir)
    logging.getLogger("rolloutd").info("data dir %s; token file %s", data_dir, data_dir / "token")
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)
