"""Wires the controller process: store + API + scheduler + executors + the kopf operator, one uvicorn server.

Called by `rolloutd controller` (`main.py`; the operator reconciles this controller's own API) and
`rolloutd operator` (it reconciles another API server's RolloutJobs into a local mirror the scheduler reads). Everything lives in the data dir (`crds/paths.DataDir`
names each file) and survives restarts: stop the controller at any point, start it again, and
every job, lease and result is where it was (local daemons keep running and are adopted).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import os
import sqlite3
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, get_args

import sqlalchemy.exc
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from rolloutd.crds import nodeenv
from rolloutd.crds.executor import ExecutorKind
from rolloutd.crds.node import CONTROLLER_KEEP_ALIVE_SECONDS
from rolloutd.crds.kit import tracing
from rolloutd.crds.kit.settings import ControllerSettings

from . import dialects
from .access.allowlists import AllowLists
from .api import create_app
from .root import Root, assemble
from .access.auth import TokenBook, ensure_token
from .store.faults import opening_problem
from rolloutd.crds.kit.paths import DEFAULT_HOST, DEFAULT_PORT, DataDir
from . import executors as registry
from .executors.local import LocalExecutor
from .executors.base import Executor, Site, advertised_url
from .access.nodeauth import NodeCredentials
from .operator import embedded
from .operator.handlers import Nudges, Reconciler
from .operator.kubeapi import Connection, JobApi
from .operator.mirror import StoreMirror
from .health.stalls import StallSampler
from .http import connection_budget
from .http.connection_budget import ConnectionBudget, budget_for, listening_socket, raise_descriptor_limit
from .store.wal_checkpoints import BACKSTOP_PAGES, Checkpointer
from .work import tracing as attempt_traces
from .work.core import Work
from .store import Store
from .ha.leadership import Leadership
from .ha.replicas import Replica, replica_urls
from .store.db import SchemaTooNew, ServerTooOld

EXECUTOR_KINDS: tuple[str, ...] = get_args(ExecutorKind)
HEAD_SECONDS = 10.0  # a request head must arrive whole within this (`_RequestDeadlines`)
BODY_SECONDS = 60.0  # and its body within this of its head (64 MiB, a node's largest, at 1.1 MB/s)


@dataclass(frozen=True)
class Controller:
    """The controller as built: its app, the parts it is made of (`root.Root`) and what a stop does before the
    server waits for its open connections (`_Server.shutdown`)."""
    app: FastAPI
    root: Root
    before_shutdown: Callable[[], Awaitable[None]]


def build_app(data_dir: Path, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT, resync: float = 2.0,
              node_grace_seconds: float = 30.0, executors: tuple[str, ...] = EXECUTOR_KINDS,
              operator: bool = True, kube: Connection | None = None, tls: bool = False,
              ca_file: Path | None = None, keep_daemons: bool = False, settings: ControllerSettings | None = None,
              leadership: Leadership | None = None) -> Controller:
    """`operator`: run the kopf handlers in this process; `kube`: against that API server (the jobs are
    mirrored into this controller's store), else against this controller's own API. `tls`: served over
    https, the local daemons trusting `ca_file` (the CA that signed the certificate). `keep_daemons`: a graceful
    stop leaves the local daemons running, for a restart to adopt (else it releases them). `settings`: the
    controller's variables, read once by its entry point (`main.py`; the defaults when omitted). `leadership`: this
    replica leads (`replicas.py`): every commit of its store is fenced by the lease's epoch."""
    settings = settings or ControllerSettings()
    paths = DataDir(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    location = settings.store or paths.db  # an SQLite file (the data dir's by default) or a postgresql:// URL
    # a store's clients hold its token (a server's store: the data dir says nothing of it, a token may be minted)
    token = ensure_token(paths.token, mint=dialects.is_url(location) or not Path(location).exists())
    credentials = NodeCredentials(paths.node_credentials)  # per job: the executors mint and revoke them
    try:
        store = Store(location, watch_history=settings.watch_history, home=data_dir)
    except (sqlalchemy.exc.DatabaseError, sqlite3.DatabaseError) as e:
        raise SystemExit(opening_problem(store_name(location), e)) from None
    except (SchemaTooNew, ServerTooOld, ImportError) as e:
        raise SystemExit(f"rolloutd: {e}") from None
    if leadership is not None:
        leadership.fence(store.engine)
    store.listen()  # PostgreSQL: other controllers' writes wake our watches and leave our cache (LISTEN/NOTIFY)
    nudges = Nudges()  # the scheduler nudges a job whose last rollout ended: the reconciler marks it at once
    reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    scheme = "https" if tls else "http"
    replicas = replica_urls(settings.replicas)  # the daemons get every replica's address, this one's first

    def make_executors(work: Work | None) -> dict[str, Executor]:
        # daemons elsewhere reach $ROLLOUTD_ADVERTISE_URL or this host's name: a DNS lookup, made only when asked
        remote = functools.cache(lambda: urls(advertised_url(host, port, scheme, settings.advertise_url), replicas))
        site = Site(data_dir, credentials, settings, local_url=urls(f"{scheme}://{reach}:{port}", replicas),
                    remote_url=remote, ca_file=ca_file,
                    grace_seconds=node_grace_seconds, nodes=work and work.registry, event=store.add_event, kube=kube)
        # the local one is always made: it adopts, and at a stop releases, the daemons an earlier run left
        made_all.update(registry.make(dict.fromkeys(["local", *executors]), site))  # every one made is shut down
        return {k: v for k, v in made_all.items() if k in executors}

    made_all: dict[str, Executor] = {}
    root = assemble(store, token, credentials=credentials, tokens=TokenBook(paths.tokens), allow=AllowLists.of(settings),
                    executors=make_executors,
                    work=dict(on_idle=nudges.nudge, max_episodes=settings.max_episodes_per_backend,
                              backend_tokens=settings.backend_tokens,
                              node_calls_per_second=settings.node_calls_per_second,
                              result_retention=settings.result_retention_seconds,
                              stall_seconds=settings.stalled_after_seconds),
                    trace_url=settings.trace_url)
    scheduler = root.scheduler
    assert scheduler is not None and root.work is not None
    app = create_app(root)
    own = Connection(f"{scheme}://{reach}:{port}", token, insecure=True)
    mirror = StoreMirror(store) if kube is not None else None
    stop, tasks, clients = asyncio.Event(), [], []

    async def stop_operator() -> None:  # before the server waits for open connections (kopf's watch)
        stop.set()
        if operator and tasks:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(tasks[-1]), 15)
        for client in clients:  # its idle connections to this server: over TLS, each would hold the server's exit
            await client.aclose()

    async def before_shutdown() -> None:
        root.work.feed.stop()  # long polls answer 503 + Retry-After, follow streams end: clients resume elsewhere
        root.work.policies.stop()  # and so do the daemons' policy watches
        await stop_operator()

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        warm_executor(asyncio.get_running_loop())
        tasks.extend([asyncio.create_task(scheduler.run(), name="scheduler"),
                      asyncio.create_task(root.loop_lag.run(), name="loop-lag")])
        if operator:
            api = JobApi(kube or own)
            clients.append(api)
            reconciler = Reconciler(api, root.executors, scheduler, interval=resync, nudges=nudges,
                                    mirror=mirror and mirror.put, forget=mirror and mirror.drop)
            tasks.append(asyncio.create_task(embedded.run(kube or own, reconciler, stop), name="operator"))
        tune_gc()
        checkpoints = store.path and Checkpointer(store.path).start()  # SQLite's WAL copied back off the loop
        store.checkpoint_aside(BACKSTOP_PAGES)
        sampler = settings.stall_samples and StallSampler(settings.stall_samples, lambda: root.loop_lag.ticked,
                                                          threading.get_ident()).start()
        try:
            yield
        finally:
            if sampler:
                sampler.stop()
            if checkpoints:
                checkpoints.stop()
            await stop_operator()
            scheduler.stop()
            local = made_all["local"]
            if not keep_daemons and isinstance(local, LocalExecutor):  # stopped on purpose: no daemon of ours
                released = local.release_all()                          # outlives us (a crash or SIGKILL keeps them)
                if released:
                    logging.getLogger("rolloutd").info("released %d local node daemon(s)", released)
            for ex in made_all.values():
                await ex.shutdown()
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    app.router.lifespan_context = lifespan
    return Controller(app, root, before_shutdown)


# The cyclic collector for a server holding tens of thousands of leases: the objects of start-up frozen out of it, the
# young generation collected every 50 000 allocations, not 700 (measured: docs/content/benchmarks.md, "Constants")
GC_THRESHOLDS = (50_000, 20, 100)


def urls(first: str, others: list[str]) -> str:
    """The controller's addresses as a daemon takes them: comma-separated, `first` first, each once."""
    return ",".join(dict.fromkeys([first, *others]))


def store_name(location: Path | str) -> str:
    """The store as messages name it (a server's URL without its password)."""
    return dialects.redacted(location) if dialects.is_url(location) else str(location)


def tune_gc() -> None:
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def warm_executor(loop: asyncio.AbstractEventLoop) -> None:
    """The loop's default executor (`asyncio.to_thread`) with every worker thread started now, before serving: a
    worker started later is started on the event loop, and `Thread.start` waits until the new thread has run
    (issue 36: 1.6 s of the loop on a host at load 19 while a batch opened in another worker)."""
    n = min(32, (os.cpu_count() or 1) + 4)  # ThreadPoolExecutor's own default
    pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="asyncio")
    started = threading.Barrier(n + 1)
    for _ in range(n):  # each waits for the others: no worker is idle, so each submit starts one more
        pool.submit(started.wait, 60)
    with contextlib.suppress(threading.BrokenBarrierError):
        started.wait(60)
    loop.set_default_executor(pool)


def run_controller(data_dir: Path, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                   log_level: str = "info", executors: tuple[str, ...] = EXECUTOR_KINDS,
                   tls: tuple[Path, Path] | None = None, operator: bool = True,
                   kube: Connection | None = None, ca_file: Path | None = None, keep_daemons: bool = False,
                   settings: ControllerSettings | None = None) -> None:
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # the operator's every status write otherwise
    tracing.setup("rolloutd-controller", nodeenv.tracing_on((settings or ControllerSettings()).tracing))
    budget = ConnectionBudget(budget_for(raise_descriptor_limit(), (settings or ControllerSettings()).max_connections))

    def build(leadership: Leadership | None = None) -> Controller:
        built = build_app(data_dir, host=host, port=port, executors=executors, operator=operator, kube=kube,
                          tls=tls is not None, ca_file=ca_file or (tls and tls[0]), settings=settings,
                          keep_daemons=keep_daemons or leadership is not None, leadership=leadership)
        built.root.metrics.register(connection_budget.Collector(budget))
        return built
    built: Controller | Replica
    if settings and settings.replicas:  # a replica: a follower until it leads (its daemons outlive a hand-over)
        reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        own = advertised_url(reach, port, "https" if tls else "http", settings.advertise_url)
        built = Replica(data_dir, own, settings, build)
    else:
        built = build()
    logging.getLogger("rolloutd").info("data dir %s; store %s; token file %s", data_dir,
                                       store_name((settings and settings.store) or DataDir(data_dir).db),
                                       DataDir(data_dir).token)
    logging.getLogger("rolloutd").info("point rolloutctl and the Python client at this controller with: %s",
                                       connect_hint(data_dir, host, port, tls is not None,
                                                    ca_file or (tls and tls[0]), settings and settings.advertise_url))
    _Server(server_config(built.app, host, port, log_level, tls, budget), built.before_shutdown).run()
    tracing.flush()   # the last spans batched, when no signal stopped it (`_Server.capture_signals` sends them then)


def connect_hint(data_dir: Path, host: str, port: int, tls: bool, ca_file: Path | None,
                 advertise_url: str | None = None) -> str:
    """The environment that points rolloutctl and the trainer client at this controller."""
    parts = [f"ROLLOUTD_SERVER={advertised_url(host, port, 'https' if tls else 'http', advertise_url)}",
             f"ROLLOUTD_TOKEN_FILE={DataDir(data_dir).token}"]
    if tls and ca_file:
        parts.append(f"ROLLOUTD_CA_FILE={ca_file}")
    return "export " + " ".join(parts)


class _RequestDeadlines(H11Protocol):
    """uvicorn's h11 protocol, with deadlines uvicorn has none of: a request head is due whole within HEAD_SECONDS
    (from the connection's start, or from its first byte after a response: that byte ends the keep-alive timer), and
    a request's body within BODY_SECONDS of its head (not counting time in which uvicorn stopped reading until the app
    reads); past either the connection is closed. Without them a client that sent no head, half a head, or a body's
    declared length never whole (slowloris) held its socket for good."""

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._timed: Any = None  # the request whose head (None: the connection's first) or body is due
        self._budget: ConnectionBudget | None = getattr(self.config, "connection_budget", None)
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1
        self._arm("head")

    def _arm(self, what: str) -> None:
        self._what, self._timed = what, self.cycle
        self._timer = self.loop.call_later(HEAD_SECONDS if what == "head" else BODY_SECONDS, self._late)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _late(self) -> None:
        self._timer = None
        if self._what == "body" and self.flow.read_paused:  # uvicorn waits for the app to read: not the client's time
            self._arm("body")
            return
        upgraded = self.transport.get_protocol() is not self  # a websocket's now: not ours to time
        waiting = self.cycle is self._timed and (self._what == "head" or self.cycle.more_body)
        if waiting and not upgraded and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm("head")  # the next head's first byte: uvicorn's keep-alive timer ends here
        super().data_received(data)
        if self.cycle is None:
            return
        if self.cycle is not self._timed:  # a head is in: its body, if it has one, is due next
            if self._budget is not None:
                self._budget.serving(self._fd)
            self._disarm()
            self._timed = self.cycle
            if self.cycle.more_body:
                self._arm("body")
        elif self._what == "body" and not self.cycle.more_body:  # the body is in
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request's cycle at once
        if self._budget is not None and (self.cycle is None or self.cycle.response_complete):
            self._budget.waiting(self._fd)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._budget is not None:
            self._budget.gone(self._fd)
        super().connection_lost(exc)


def server_config(app: object, host: str, port: int, log_level: str = "info",
                  tls: tuple[Path, Path] | None = None, budget: ConnectionBudget | None = None) -> uvicorn.Config:
    """uvicorn's settings for the controller: idle connections kept past any daemon's (its beats reuse one); a
    request's head and body due within HEAD_SECONDS and BODY_SECONDS (`_RequestDeadlines`); connections bounded by
    `budget` when one is given (`connection_budget`: `_Server` listens on a socket that counts them)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, http=_RequestDeadlines,
                            timeout_keep_alive=int(CONTROLLER_KEEP_ALIVE_SECONDS), timeout_graceful_shutdown=5,
                            ssl_certfile=tls and str(tls[0]), ssl_keyfile=tls and str(tls[1]))
    config.connection_budget = budget  # type: ignore[attr-defined]
    return config


class _Server(uvicorn.Server):
    """Stops the operator first on exit (its watch is an open connection the server would wait for) and answers
    the trainers' long polls, which would otherwise be cancelled mid-wait after the graceful timeout (a 500)."""

    def __init__(self, config: uvicorn.Config, before_shutdown: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self.before_shutdown = before_shutdown

    async def startup(self, sockets=None) -> None:
        """Listens on a socket that counts what it accepts (`connection_budget.ListeningSocket`), when the config
        names a TCP host and port and has a budget."""
        budget = getattr(self.config, "connection_budget", None)
        if sockets is None and budget is not None and self.config.uds is None and self.config.fd is None:
            try:
                sockets = [listening_socket(self.config.host, self.config.port, budget)]
            except OSError as e:  # as uvicorn's own bind says it (a port in use): one line, not a traceback
                logging.getLogger("uvicorn.error").error("cannot listen on %s:%s: %s", self.config.host,
                                                         self.config.port, e)
                sys.exit(1)
        await super().startup(sockets=sockets)

    async def shutdown(self, sockets=None) -> None:
        await self.before_shutdown()
        await super().shutdown(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, the last spans sent before it raises again the SIGTERM it caught (whose default action ends the
        process there: no exit hook, nothing after `run()`; ~2 % of a scale run's roots were lost so)."""
        with super().capture_signals():
            try:
                yield
            finally:
                attempt_traces.stopped()
