"""A controller replica (ROLLOUTD_REPLICAS set): one ASGI app that is a follower until it wins the leader lease,
then the whole controller of `server.build_app` (scheduler, operator, executors), built from the database then.

Called by `server.run_controller`; the lease and the fence are `leadership.py`. A follower serves from the shared
database what needs no scheduler: the Kubernetes verbs (get, list, watch, apply, delete), events, tenant
policies, discovery, the web UI, probes and its own metrics. It forwards to the leader what the leader's scheduler
holds in memory (held leases, backend admission, node liveness: `work/held_leases.py` says why they are not
written): the node protocol, the trainer routes (streams included) and the daemons' logs; with no leader now,
503 + Retry-After, which every client retries (on another address when it has several). Each replica polls the
change log (`store/change_poll.py`), so a write on one wakes the watches and the operator of all. On PostgreSQL (unless
ROLLOUTD_NODE_SHARDS=0) the node protocol is not forwarded to the leader: each replica serves the nodes it owns
(`shards.py`) with a work core of its own; another's node's call: 421 naming the owner (owner-redirect) or forwarded.
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Callable

import httpx
from prometheus_client import Counter

from rolloutd.crds.node import FAILOVER_CALL_SECONDS, OWNER_REDIRECT
from rolloutd.crds.kit.settings import ControllerSettings

from .. import dialects
from ..api import create_app
from ..errors import ApiError
from ..access.auth import TokenBook, ensure_token, token_matches
from ..access.allowlists import AllowLists
from .leadership import EXIT_LOST, Leadership, current
from ..access.nodeauth import NodeCredentials, NodeGate
from ..root import assemble
from ..replies import misdirected, read_body, refused, replay, unavailable
from .serving import Serving
from .shards import OWNER, UNREACHABLE, Shards
from ..store import Store
from ..store.change_poll import POLL_SECONDS, ChangePoller
from rolloutd.crds.kit.paths import DataDir

log = logging.getLogger("rolloutd.replicas")

FORWARDED = "x-rolloutd-forwarded"  # set on a forwarded call: a follower never forwards one again
_LEADER_PATH = re.compile(r"(?:/apis/rolloutd\.io/v1alpha1)(?:/namespaces/[^/]+)?/rolloutjobs/[^/]+/"
                          r"(?:trajectories|groups|batches|policy|backends|stats|inflight|logs)(?:/.*)?")
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


def leader_only(path: str) -> bool:
    """What a follower forwards: the node protocol and the routes of the leader's scheduler."""
    return NodeGate.is_node_path(path) or _LEADER_PATH.fullmatch(path) is not None


class Replica:
    """The ASGI app of a replica: `follower` until elected, then `leader` (`build(leadership)` →
    `server.build_app`, a `server.Controller`). Losing the lease ends the process (`leadership.EXIT_LOST`)."""

    def __init__(self, data_dir: Path, url: str, settings: ControllerSettings,
                 build: Callable[[Leadership], Any]) -> None:
        paths = DataDir(data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        location = settings.store or paths.db  # an SQLite file or a postgresql:// URL (`server.build_app`)
        with open(data_dir / ".replicas.lock", "a") as lock:  # replicas starting together migrate one at a time
            fcntl.flock(lock, fcntl.LOCK_EX)
            token = ensure_token(paths.token, mint=dialects.is_url(location) or not Path(location).exists())
            self.store = Store(location, watch_history=settings.watch_history, home=data_dir)
        self.store.listen()  # PostgreSQL: LISTEN/NOTIFY as well as the change-log poll
        # no executors: what needs them is forwarded to the leader (`leader_only`); on PostgreSQL a work core that
        # serves the node calls of the nodes this replica owns (`shards.py`), on SQLite none (one writer: the leader)
        sharded = node_shards(location, settings.node_shards)
        self.shards = Shards(self.store.engine, url, lease_seconds=settings.leader_lease_seconds) if sharded else None
        work = dict(max_episodes=settings.max_episodes_per_backend, backend_tokens=settings.backend_tokens,
                    result_retention=settings.result_retention_seconds, node_calls_per_second=settings.node_calls_per_second, stall_seconds=settings.stalled_after_seconds)
        self.root = assemble(self.store, token, credentials=NodeCredentials(paths.node_credentials),
                             tokens=TokenBook(paths.tokens), allow=AllowLists.of(settings),
                             trace_url=settings.trace_url, work=work if self.shards else None)
        self.serving: Serving | None = None  # the nodes the serving work core (ours, or the leader's) serves
        # a node's calls (not registrations) answered here, or forwarded to the replica that owns the node
        self.node_calls = Counter("rolloutd_replica_node_calls", "Node calls of a node this replica owns (served), "
                                  "another does (forwarded, or redirected: 421 naming it), one it handed over at the "
                                  "call (handed) or took over from an owner its daemon could not reach (taken), or one "
                                  "its fence found another's (fenced)", ["how"], registry=self.root.metrics)
        self.follower = create_app(self.root)
        self.leader: Any = None  # the leader's `server.Controller`, once elected
        self.build, self.url = build, url
        self.leadership = Leadership(self.store.engine, url, lease_seconds=settings.leader_lease_seconds)
        self._leader_url: tuple[float, str] = (0.0, "")
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=2.0))
        self._exit: Callable[[int], None] = os._exit

    @property
    def app(self) -> "Replica":  # what `server.run_controller` serves (as a `server.Controller`'s app)
        return self

    async def before_shutdown(self) -> None:
        """The leader's stop before the server waits for open connections (`server._Server`); a follower's: none."""
        if self.leader is not None:
            await self.leader.before_shutdown()

    async def __call__(self, scope, receive, send) -> None:
        if self.shards is not None and scope["type"] == "http" and NodeGate.is_node_path(scope["path"]) \
                and not scope["path"].endswith("/nodes/credential"):  # minted by the leader's executors alone
            return await self._node_call(scope, receive, send)
        if self.leader is not None:
            return await self.leader.app(scope, receive, send)
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] == "http" and leader_only(scope["path"]):
            return await self._forward(scope, receive, send)
        return await self.follower(scope, receive, send)

    # ------------------------------------------------------------ life

    async def _lifespan(self, receive, send) -> None:
        loop = asyncio.get_running_loop()
        elected = asyncio.Event()
        self.leadership.on_elected = lambda epoch: loop.call_soon_threadsafe(elected.set)
        self.leadership.on_lost = self._lost
        pollers = [ChangePoller(self.store)]
        tasks = [asyncio.create_task(pollers[0].run(), name="change-poller"),
                 asyncio.create_task(self.root.loop_lag.run(), name="loop-lag")]
        leading: list[contextlib.AbstractAsyncContextManager] = []

        async def promote() -> None:
            await elected.wait()
            started = time.monotonic()
            built = self.build(self.leadership)  # its store is fenced (`Leadership.fence`) before any write
            # the leases it adopted: their daemons may still be waiting on the old leader (a paused one answers
            # nothing) for up to FAILOVER_CALL_SECONDS before they call us
            work = built.root.work
            if self.shards is not None:  # our node work's memory ends here: the leader's serves our nodes now
                assert self.root.scheduler is not None
                self.root.scheduler.stop()
                self.serving = Serving(self.shards, work)
                self._rebalance(self.shards.owned, self.shards.moves, reset=True)  # it loaded every lease: ours kept
            work.queue.leases.grace(time.time() + FAILOVER_CALL_SECONDS, work.lease_seconds)
            ctx = built.app.router.lifespan_context(built.app)
            if self.shards is not None:
                built.root.metrics.register(self.node_calls)  # the leader's /metrics goes on counting them
            self.leader = built  # before its operator starts: its calls to our own port reach the leader's app
            await ctx.__aenter__()
            leading.append(ctx)
            pollers.append(ChangePoller(built.root.store))
            tasks.append(asyncio.create_task(pollers[-1].run(), name="change-poller-leader"))
            log.info("leader: serving the whole controller (epoch %s; built in %.2f s)", self.leadership.epoch,
                     time.monotonic() - started)

        await receive()  # lifespan.startup
        if self.shards is not None:
            self.shards.on_refresh = lambda owned, moves: loop.call_soon_threadsafe(self._rebalance, owned, moves)
            await asyncio.to_thread(self.shards.start)
            self.serving = Serving(self.shards, self.root.work)
            self._rebalance(self.shards.owned, self.shards.moves, reset=True)
            assert self.root.scheduler is not None
            tasks.append(asyncio.create_task(self.root.scheduler.run(), name="node-work"))
            tasks.append(asyncio.create_task(self._publish(), name="node-stages"))
        self.leadership.start()
        tasks.append(asyncio.create_task(promote(), name="promote"))
        await send({"type": "lifespan.startup.complete"})
        await receive()  # lifespan.shutdown
        for p in pollers:
            p.stopped = True
        self.leadership.stop()
        if self.shards is not None:
            self.shards.stop()
            if self.leader is None and self.root.scheduler is not None:
                self.root.scheduler.stop()
            self.shards.resign()  # our nodes move to the others at their next refresh
        for ctx in leading:
            with contextlib.suppress(Exception):
                await ctx.__aexit__(None, None, None)
        self.leadership.resign()  # after the scheduler stopped: a follower takes over at its next try
        for t in tasks:
            t.cancel()
        await self._http.aclose()
        await send({"type": "lifespan.shutdown.complete"})

    def _lost(self, reason: str) -> None:
        """Step down: this process's scheduler state is the old epoch's; it ends (its fenced writes were refused) and
        its supervisor starts it again as a follower. Its node daemons live on and move to the new leader."""
        logging.getLogger("rolloutd").critical("leadership lost (%s): exiting with status %d", reason, EXIT_LOST)
        for h in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                h.flush()
        self._exit(EXIT_LOST)

    # ------------------------------------------------------------ node shards (PostgreSQL)

    def _rebalance(self, owned: dict[str, int], moves: dict[str, int], reset: bool = False) -> None:
        """After a refresh: the serving work core (the leader's, else ours) serves the nodes owned here now."""
        assert self.serving is not None and self.shards is not None
        work = self.serving.work
        lost, loaded = self.serving.sync(owned, moves, reset)
        work.queue.leases.elsewhere = self.shards.elsewhere
        work.pool.admission.replicas = len(self.shards.members)
        if lost or loaded:
            log.info("node shards: %d nodes served here; %d nodes handed on, %d leases adopted", len(owned), lost,
                     loaded)

    async def _publish(self) -> None:
        """The stages of the leases served here, copied on the loop for the shards' thread to write each second."""
        while True:
            work = self.leader.root.work if self.leader is not None else self.root.work
            self.shards.local = {job: dict(st) for job, st in work.queue.leases._stages.items()}
            await asyncio.sleep(POLL_SECONDS * 5)

    async def _node_call(self, scope, receive, send) -> None:
        """A node call: served here when this replica owns the node (or it is a registration), else answered 421 naming
        the owner (`_redirects`) or forwarded to it, the reply naming it (`shards.OWNER`): the daemon moves to it. A node
        of ours above our fair share is handed over first (`Shards.give`). The fence of the call's transaction has the
        last word (`serving.Serving.check_ahead`): a call it refuses goes the same way, or (forwarded: no second hop)
        503."""
        node_id = scope["path"].rstrip("/").split("/nodes/", 1)[1].split("/", 1)[0]
        forwarded = any(k.lower() == FORWARDED.encode() for k, _ in scope["headers"])
        app = self.leader.app if self.leader is not None else self.follower
        if node_id == "register":
            return await app(scope, receive, send)
        if not forwarded:
            unreachable = next((v.decode("latin-1").rstrip("/") for k, v in scope["headers"]
                                if k.lower() == UNREACHABLE.encode()), "")
            if unreachable and not await asyncio.to_thread(self._authentic, scope):
                unreachable = ""  # (the app refuses the call itself) a move is never made on an unchecked word
            owner = await self._owner(node_id, unreachable)
            if owner != self.shards.url:
                if await self._redirects(node_id):
                    self.node_calls.labels("redirected").inc()
                    return await misdirected(send, node_id, owner)
                self.node_calls.labels("forwarded").inc()
                return await self._forward(scope, receive, send, owner)
        try:
            body = await read_body(scope, receive)
        except ApiError as e:  # past the limit, or the client left inside it
            return await refused(send, e)
        fenced: list[str] = []

        async def answer(message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 503:
                fenced.extend(v.decode("latin-1") for k, v in message["headers"] if k.decode("latin-1").lower() == OWNER)
            if not fenced:
                await send(message)

        await app(scope, replay(body, receive), answer)
        if not fenced:
            if not forwarded:
                self.node_calls.labels("served").inc()
            return
        owner = fenced[0].rstrip("/")
        self.shards.owners[node_id] = owner
        self.node_calls.labels("fenced").inc()
        if forwarded or owner == self.shards.url:
            return await unavailable(send, f"node {node_id} is served by {owner}: retry there", owner)
        if await self._redirects(node_id):  # (its transaction rolled back: nothing of the call was processed)
            return await misdirected(send, node_id, owner)
        return await self._forward(scope, replay(body, receive), send, owner)

    async def _redirects(self, node_id: str) -> bool:
        """The node's daemon registered with feature owner-redirect: a call of it to us that another replica owns is
        answered 421 naming the owner, not forwarded (it re-sends it there: `agents/daemon/controller_client.py`)."""
        reg = (self.leader.root.work if self.leader is not None else self.root.work).registry
        features = reg.features.get(node_id)  # (read from its row once)
        return OWNER_REDIRECT in (features if features is not None else await asyncio.to_thread(reg.features_of, node_id))

    def _authentic(self, scope) -> bool:
        """The call carries the admin token or its node's own (as the app checks it, `middleware.AuthAndMetrics`)."""
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"authorization"), None)
        if token_matches(header, self.root.token):
            return True
        bearer = header[len("Bearer "):].strip() if header and header.startswith("Bearer ") else None
        reg = (self.leader.root.work if self.leader is not None else self.root.work).registry
        return NodeGate(self.root.credentials, reg.job_of).check(scope["path"], bearer)[0]

    async def _owner(self, node_id: str, unreachable: str = "") -> str:
        """The node's owner for a call it made to us: our view of the rows, the row itself when the view names
        another (it may be ours since the view was read), ours handed over now when we are above our share, and
        ours taken over now when its daemon could not reach the owner the row names (`unreachable`, sent back by the
        daemon after our 421 named it: `Shards.take_over`)."""
        shards = self.shards
        owner = shards.owners.get(node_id)
        if owner != shards.url:
            owner = await asyncio.to_thread(shards.owner, node_id)
        if owner != shards.url and owner == unreachable:
            if await asyncio.to_thread(shards.take_over, node_id, owner):
                self.node_calls.labels("taken").inc()
                return shards.url
            owner = await asyncio.to_thread(shards.owner, node_id)  # moved meanwhile, or its call on it still open
        to = shards.give.pop(node_id, None)
        if owner == shards.url and to in shards.members and await asyncio.to_thread(shards.hand_over, node_id, to):
            self.serving.drop({node_id})  # the fence refuses our calls of it from its commit on; memory now
            self.node_calls.labels("handed").inc()
            return to
        return owner

    # ------------------------------------------------------------ forwarding to the leader

    async def leader_url(self) -> str:
        """The leader's URL from the lease row (read at most every POLL_SECONDS); "" when no one leads now."""
        at, url = self._leader_url
        if time.monotonic() - at > POLL_SECONDS:
            holder, _, expires, url = await asyncio.to_thread(current, self.store.engine)
            url = url if holder and expires > time.time() - 1.0 and url.rstrip("/") != self.url.rstrip("/") else ""
            self._leader_url = (time.monotonic(), url)
        return url

    async def _forward(self, scope, receive, send, owner: str = "") -> None:
        """To the leader, or to `owner` (a node's: its reply names it)."""
        headers = [(k, v) for k, v in scope["headers"] if k.decode("latin-1").lower() not in _HOP]
        url = owner or ("" if any(k.lower() == FORWARDED.encode() for k, _ in headers) else await self.leader_url())
        if not url:
            return await unavailable(send, "no controller leads now (an election is under way): retry")
        try:
            body = await read_body(scope, receive)
        except ApiError as e:  # past the limit, or the client left inside it
            return await refused(send, e)
        target = url.rstrip("/") + (scope.get("raw_path") or scope["path"].encode()).decode("latin-1") + (
            "?" + scope["query_string"].decode("latin-1") if scope["query_string"] else "")
        request = self._http.build_request(scope["method"], target, content=body,
                                           headers=headers + [(FORWARDED.encode(), b"1")])
        try:
            resp = await self._http.send(request, stream=True)
        except httpx.HTTPError as e:
            self._leader_url = (0.0, "")
            return await unavailable(send, f"the leader {url} did not answer ({type(e).__name__}): retry")
        try:
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": [(k, v) for k, v in resp.headers.raw if k.decode("latin-1").lower() not in _HOP]
                        + ([(OWNER.encode(), owner.encode())] if owner and OWNER not in resp.headers else [])})
            try:
                async for chunk in resp.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError:
                pass  # the leader went away mid-stream: the stream ends, the client resumes from its cursor
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await resp.aclose()


def node_shards(location: str | Path, setting: str | None) -> bool:
    """Whether replicas on this store serve their own nodes (`shards.py`): on PostgreSQL unless ROLLOUTD_NODE_SHARDS
    turns them off; never on SQLite (one writer: the leader)."""
    return dialects.is_url(location) and (setting or "on").strip().lower() not in ("0", "false", "no", "off")


def replica_urls(raw: str | None) -> list[str]:
    """ROLLOUTD_REPLICAS split: every replica's URL."""
    return [u.strip().rstrip("/") for u in (raw or "").split(",") if u.strip()]

