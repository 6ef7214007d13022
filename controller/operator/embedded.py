"""Runs the kopf handlers inside a process's event loop: against the controller's own API (the embedded
default of `rolloutd controller`) or another API server (`rolloutd operator --kubeconfig`).

Called from the controller's lifespan (`server.py`). Standalone (no peering), cluster-wide; kopf logs
in through a login handler with the `Connection`'s token. Next step: the handlers (`handlers.py`).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any
from urllib.parse import urlsplit

import kopf

from ..store.schema import RELEASE_FINALIZER
from .handlers import Reconciler, build_registry
from .kubeapi import Connection

log = logging.getLogger("rolloutd.operator")
_ANNOTATIONS = "rolloutd.io"


def settings() -> kopf.OperatorSettings:
    """kopf's settings for rolloutd: its finalizer is the one every RolloutJob carries from creation, its
    own state lives in `rolloutd.io/…` annotations (the status schema has no room for kopf's), and only
    explicit events are posted (the handlers' own; kopf's for a handler that failed)."""
    s = kopf.OperatorSettings()
    s.persistence.finalizer = RELEASE_FINALIZER
    s.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=_ANNOTATIONS)
    s.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=_ANNOTATIONS, key="last-handled-configuration")
    s.posting.reporting_component = "rolloutd-operator"
    s.posting.level = logging.WARNING
    s.networking.error_backoffs = [0.1, 0.5, 1, 2, 5, 10]  # the embedded API starts with us: retry soon
    s.watching.server_timeout = 300  # the watch ends now and then; kopf resumes it from its resourceVersion
    s.process.ultimate_exiting_timeout = None  # the host process decides when to exit, not kopf
    return s


async def run(conn: Connection, memo: Reconciler, stop: asyncio.Event,
              ready: asyncio.Event | None = None) -> None:
    """The operator until `stop` is set. The process keeps its own SIGINT/SIGTERM handlers (uvicorn's):
    kopf installs its own when started in the main thread, and they are put back right after."""
    await _reachable(conn.server, stop)
    registry = build_registry()

    @kopf.on.login(registry=registry)
    async def login(**_: Any) -> kopf.AiohttpSession:
        return kopf.AiohttpSession(aiohttp_session=conn.aiohttp_session(), server=conn.server)

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    host_tasks = asyncio.all_tasks()  # the server's own: kopf must not cancel them when it stops
    tasks = await kopf.spawn_tasks(registry=registry, settings=settings(), standalone=True, clusterwide=True,
                                   memo=memo, stop_flag=stop, ready_flag=ready)
    loop = asyncio.get_running_loop()
    for sig, handler in saved.items():
        with contextlib.suppress(ValueError, RuntimeError):  # not the main thread: kopf left them alone
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)
    await kopf.run_tasks(tasks, ignored=host_tasks)


async def _reachable(server: str, stop: asyncio.Event, timeout: float = 60.0) -> None:
    """Wait until the API server accepts connections (the embedded one starts listening after us), so
    that kopf's first requests do not fail and back off."""
    url = urlsplit(server)
    port = url.port or (443 if url.scheme == "https" else 80)
    deadline = asyncio.get_running_loop().time() + timeout
    while not stop.is_set() and asyncio.get_running_loop().time() < deadline:
        try:
            _reader, writer = await asyncio.open_connection(url.hostname, port)
        except OSError:
            await asyncio.sleep(0.02)
            continue
        writer.close()
        return
