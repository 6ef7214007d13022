"""The API's ASGI middleware: the bearer-token check and the request metrics around every request, and a write's
sync before its 2xx. Installed by `api.create_app`; a request it lets through goes on to the app's routes.

Every endpoint but the probes needs a bearer token: the admin token, a node credential (node paths only, its own job
or node: `access/nodeauth.py`) or a scoped one (`http/access.py`: 403 beyond it; never on node paths; it waits its
turn of its request rate first, `http/request_rate.py`). /ui/… checks its own (`ui/app.py`). The unnamespaced trainer
paths of the previous version are rewritten to the `default` namespace's here. Errors are Kubernetes `Status`
objects (`error_response`; see `errors.py`).
"""
from __future__ import annotations

import logging
import re
import time
from typing import Awaitable, Callable

from fastapi.responses import JSONResponse
from prometheus_client import Counter, Histogram

from rolloutd.crds.names import API_PREFIX as PREFIX

from .access.auth import TokenBook, token_matches
from .access.nodeauth import NodeGate
from .errors import ApiError, Forbidden, ServiceUnavailable, TooManyRequests, Unauthorized
from .http.access import forbidden
from .http.login_limit import LoginLimits
from .http.request_rate import RequestRates
from .kube.admit import TOKEN_KEY
from .store.faults import RETRY_AFTER_SECONDS, StorageWatch, storage_reason

log = logging.getLogger("rolloutd.api")
# The trainer routes of the previous version (no namespace) are served as the `default` namespace's.
_OLD_TRAINER_PATH = re.compile(PREFIX + r"/rolloutjobs/([^/]+)/(trajectories|groups|batches|policy|backends)(/.*)?")


def _namespaced(path: str) -> str:
    m = _OLD_TRAINER_PATH.fullmatch(path)
    return path if m is None else f"{PREFIX}/namespaces/default/rolloutjobs/{m[1]}/{m[2]}{m[3] or ''}"


def error_response(err: ApiError, retry_after: int = RETRY_AFTER_SECONDS) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if err.code == 401 else \
        {"Retry-After": str(retry_after)} if err.code in (429, 503) else {}
    return JSONResponse(err.status(), status_code=err.code, headers={**headers, **err.headers} or None)


_WRITES = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_CORE_EVENTS = re.compile(r"/api/v1/namespaces/[^/]+/events")
_ANNOUNCE = re.compile(rf"{PREFIX}/namespaces/[^/]+/rolloutjobs/[^/]+/policy")  # syncs its commit itself, overlapped


def _unsynced(path: str) -> bool:
    """Writes answered without waiting for a sync: the node protocol's (its routes sync results themselves), a policy
    announce (it syncs its commit while the engines resume: `PolicyVersions._live`), and what the operator derives
    and writes again after a restart (a job's status, core/v1 Events)."""
    return NodeGate.is_node_path(path) or path.endswith("/status") or any(
        r.fullmatch(path) is not None for r in (_CORE_EVENTS, _ANNOUNCE))


class AuthAndMetrics:
    """Bearer-token check and request metrics around every request, as plain ASGI: Starlette's
    `BaseHTTPMiddleware` (`@app.middleware`) runs each request in a task group of its own, which
    cost more CPU than a node's heartbeat itself at a thousand nodes. Latency is observed when the
    response starts (a watch stream is counted once, not for its whole life). A write answered 2xx (other than
    the node protocol's, whose routes settle results themselves) waits for its commit to be on the disk
    (`durable`, `durability.Durable.settle`); a disk that refuses the sync turns the answer into a 503. A namespace
    token's request first waits its turn of its request rate (`rates`, `http/request_rate.py`), before the body."""

    def __init__(self, app, *, token: str, nodes: NodeGate | None, tokens: TokenBook, requests_total: Counter,
                 latency: Histogram, storage: StorageWatch | None = None, limits: LoginLimits | None = None,
                 durable: Callable[[], Awaitable[None]] | None = None, rates: RequestRates):
        self.storage, self.limits, self.durable, self.rates = storage, limits or LoginLimits(), durable, rates
        self._told = 0.0  # when a storage fault was last logged (one line per interval, not a traceback per call)
        self.app, self.token, self.nodes, self.tokens = app, token, nodes, tokens
        self.requests_total, self.latency = requests_total, latency

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, method, path = time.perf_counter(), scope["method"], _namespaced(scope["path"])
        if path != scope["path"]:
            scope = {**scope, "path": path, "raw_path": path.encode()}
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        started = False
        settle = self.durable if method in _WRITES and not _unsynced(path) else None

        async def send_and_count(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                if settle is not None and message["status"] < 300:
                    await settle()  # raises on a disk that refuses: answered 503 below, nothing sent yet
                started = True
                self.requests_total.labels(method, str(message["status"])).inc()
                self.latency.labels(method).observe(time.perf_counter() - start)
            await send(message)

        probe = path in ("/healthz", "/readyz")
        if not probe and self.storage is not None and (lost := self.storage.lost()):
            return await error_response(ServiceUnavailable(lost))(scope, receive, send_and_count)
        own_auth = probe or path == "/ui" or path.startswith("/ui/")  # the UI checks its own (`ui/`)
        admin = own_auth or token_matches(header, self.token)
        if not admin and NodeGate.is_node_path(path):
            bearer = header[len("Bearer "):].strip() if header and header.startswith("Bearer ") else None
            allowed, job = self.nodes.check(path, bearer) if self.nodes is not None else (False, None)
            if not allowed:  # a namespace token's 403 here spends its request rate too (`rates`)
                scoped = self.tokens.find(header)
                err: ApiError = Unauthorized("not a node credential of this job, nor this node's token") \
                    if scoped is None else await self.rates.refusal(scoped) or Forbidden(
                        "namespace tokens cannot use the node protocol: nodes use their job's node credential")
                return await error_response(err)(scope, receive, send_and_count)
            if job is not None:  # a job credential registering: the route checks the body's job against it
                scope = {**scope, "state": {**(scope.get("state") or {}), "node_job": job}}
        elif not admin:
            scoped = self.tokens.find(header)
            if scoped is None:
                client = scope.get("client")
                if header is not None and (wait := self.limits.failed(client[0] if client else None)):
                    return await error_response(TooManyRequests(
                        f"too many failed token checks from this address; retry in {wait} s (a valid token is "
                        "never refused)"), wait)(scope, receive, send_and_count)
                err = Unauthorized(
                    "missing bearer token: send 'Authorization: Bearer <token>' (the token is in the controller's "
                    "data dir, file 'token'; rolloutctl reads it via --token-file or ROLLOUTD_TOKEN)"
                    if header is None
                    else "invalid bearer token"
                )
                return await error_response(err)(scope, receive, send_and_count)
            if over := await self.rates.refusal(scoped):  # waits its turn, or 429 past the few waiting
                return await error_response(over)(scope, receive, send_and_count)
            if problem := forbidden(scoped, method, path):
                return await error_response(Forbidden(problem))(scope, receive, send_and_count)
            scope = {**scope, TOKEN_KEY: scoped}  # admission holds its writes to the namespace's policy
        try:
            await self.app(scope, receive, send_and_count)
        except ApiError as e:
            if started:
                raise
            await error_response(e)(scope, receive, send_and_count)
        except Exception as e:
            reason = storage_reason(e) if self.storage is not None else None
            if reason is None or started:
                raise
            self.storage.failed(reason)
            if time.monotonic() - self._told >= RETRY_AFTER_SECONDS:
                self._told = time.monotonic()
                log.error("%s (%s %s answered 503; more such errors in the next %d s are not logged)", reason,
                          method, path, RETRY_AFTER_SECONDS)
            await error_response(ServiceUnavailable(f"{reason}; retry later"))(scope, receive, send_and_count)
