"""The node daemon's HTTP client for the controller's node protocol (`rolloutd.crds.node`): seven POSTs, one error.

Callers: daemon.py (register, deregister), lease.py, heartbeat.py, outbox.py, policywatch.py; the server side is the controller's
node routes. `register` carries the job's node credential as `Authorization: Bearer`, every later call the
node's own token from the reply (feature node-token; the credential when the reply has none); bodies and replies
are the `crds.node` models' wire forms. `ControllerError.retryable` tells a controller briefly away (no answer, 5xx, 408, 429) from a
refusal (other 4xx); callers retry with `aiokit.Backoff`.
"""
from __future__ import annotations

import json
import ssl
from collections.abc import Sequence
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from rolloutd.agents.keepalive import KeepAliveTransport, http_proxy_configured
from rolloutd.crds.errors import StatusError
from rolloutd.crds.names import job_path
from rolloutd.crds.node import (
    DAEMON_KEEP_ALIVE_SECONDS,
    FAILOVER_CALL_SECONDS,
    FEATURES_PARAM,
    LEASE_PARAM,
    MISDIRECTED,
    OWNER_HEADER,
    UNREACHABLE_HEADER,
    Heartbeat,
    HeartbeatResponse,
    LeaseRequest,
    LeaseResponse,
    PolicyState,
    PolicyWatch,
    RegisterRequest,
    RegisterResponse,
    Result,
    ResultAck,
    ResultBatch,
    ReturnRequest,
)

NODES_PREFIX = "/apis/rolloutd.io/v1alpha1/nodes"  # the previous version's paths; the controller serves both

M = TypeVar("M", bound=BaseModel)
REDIRECTS = 3  # 421s one call follows (each names the owner as its replica read it; a move in between adds one)


class ControllerError(StatusError):
    """A call to the controller failed. `status` is the HTTP status (None: no answer at all)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def code(self) -> int | None:
        return self.status

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status >= 500 or self.status in (408, 429, MISDIRECTED)

    @property
    def gone(self) -> bool:
        """The controller does not know this node (or job) any more; 401 on a per-node call: the job's node
        credential was revoked, so the job was released (finished or deleted)."""
        return self.status in (401, 404, 410)


def result_json(result: Result) -> bytes:
    """One result's wire JSON, as `results` sends it inside a batch."""
    return json.dumps(result.wire(), separators=(",", ":")).encode()


def _asking(path: str, lease: int | None) -> str:
    return path if lease is None else f"{path}?{LEASE_PARAM}={lease}"


class ControllerClient:
    """The seven calls of the node protocol, under the job's namespaced path when `job` (its key,
    "namespace/name" or a bare name in `default`) is given. `transport` is a test seam (e.g. httpx.MockTransport).
    `base_url` may name several controller replicas, comma-separated: a call that gets no answer, or a 503, moves
    the next calls to the next address (the caller retries; any replica forwards to the leader)."""

    def __init__(self, base_url: str, token: str, *, job: str | None = None, timeout: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None, ca_file: str | None = None) -> None:
        self.addresses = [u.strip().rstrip("/") for u in base_url.split(",") if u.strip()] or [base_url.rstrip("/")]
        self.base_url = self.addresses[0]
        self._prefix = job_path(job, "nodes") if job else NODES_PREFIX
        # several replicas: a call that hangs (a paused leader accepts connections and answers none) moves on sooner
        self.timeout = timeout if len(self.addresses) == 1 else min(timeout, FAILOVER_CALL_SECONDS)
        self._credential = f"Bearer {token}"  # registers; the node's own token makes the other calls
        self.revoked = False  # a per-node call was refused 401: the job was released, nothing is wrong here
        self._http = httpx.AsyncClient(  # each call names its whole URL (`_post`): base_url + prefix + path
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout, connect=5.0),
            limits=httpx.Limits(max_connections=100, max_keepalive_connections=20,
                                keepalive_expiry=DAEMON_KEEP_ALIVE_SECONDS),
            transport=transport,
            verify=ssl.create_default_context(cafile=ca_file) if ca_file else True,
            # plain http through the keep-alive pool the LLM client uses (httpx's costs a daemon
            # CPU on every call); https and a proxied environment keep httpx's own
            mounts=None if transport or http_proxy_configured()
            else {"http://": KeepAliveTransport(keepalive_expiry=DAEMON_KEEP_ALIVE_SECONDS)},
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    def _move_on(self, failed: str) -> None:
        """The address after `failed` (where a call got no answer), for the next calls; nothing when another call
        moved them elsewhere since (a move back onto `failed` with it), or with one address."""
        if len(self.addresses) > 1 and self.base_url == failed:
            self.base_url = self.addresses[(self.addresses.index(failed) + 1) % len(self.addresses)]

    def _move_to(self, owner: str) -> None:
        """The replica that owns this node (it answered through another: `controller/ha/shards.py`), from now on."""
        if owner not in self.addresses:
            self.addresses.append(owner)
        self.base_url = owner

    async def _post(self, path: str, body: BaseModel | dict | bytes, reply: type[M] | None,
                    timeout: float | None = None, headers: dict[str, str] | None = None) -> Any:
        if isinstance(body, bytes):  # already serialized JSON
            kw: dict[str, Any] = {"content": body, "headers": {"Content-Type": "application/json", **(headers or {})}}
        else:
            kw = {"json": body.wire() if hasattr(body, "wire") else body, "headers": headers}
        # where this call goes: its own, as the daemon's other calls (beats, leases, watches) move `base_url` too
        at = self.base_url
        sender = unreachable = ""  # the replica whose 421 we follow; the owner it named, when that gave no answer
        for _ in range(REDIRECTS + 1):  # feature owner-redirect: a 421 processed nothing, re-sent to the owner it names
            sent = kw if not unreachable else {**kw, "headers": {**(kw["headers"] or {}), UNREACHABLE_HEADER: unreachable}}
            try:
                resp = await self._http.post(at + self._prefix + path, timeout=timeout or self.timeout, **sent)
            except httpx.HTTPError as e:
                if sender and not unreachable:  # back to the replica that named it: it takes the node over
                    unreachable, at = at, sender
                    self._move_to(at)
                    continue
                self._move_on(at)
                raise ControllerError(f"POST {path}: {type(e).__name__}: {e}".rstrip(": ")) from None
            if resp.status_code != MISDIRECTED or not (owner := resp.headers.get(OWNER_HEADER)) \
                    or owner.rstrip("/") == unreachable:
                break
            sender, at = at, owner.rstrip("/")
            self._move_to(at)
        if (owner := resp.headers.get(OWNER_HEADER)) and owner.rstrip("/") not in (at, unreachable):
            self._move_to(owner.rstrip("/"))  # the replica that owns the node now (a 503 too: its fence refused)
        elif resp.status_code == 503:
            self._move_on(at)
        if resp.status_code == 401 and not path.startswith("/register"):
            self.revoked = True
        if resp.status_code >= 400:
            raise ControllerError(f"POST {path}: HTTP {resp.status_code}: {resp.text[:300]}", resp.status_code)
        if reply is None:
            return None
        try:
            return reply.model_validate(resp.json() if resp.content else {})
        except (ValueError, ValidationError) as e:
            # a controller of another version, or a proxy's error page with status 200
            raise ControllerError(f"POST {path}: unexpected reply: {e}"[:500], resp.status_code) from None

    async def register(self, req: RegisterRequest, features: Sequence[str] = ()) -> RegisterResponse:
        """`features`: the `crds.node.FEATURES` to ask for (`?features=a,b`); the reply's `features` are those
        served (None: an older controller, which ignores the parameter)."""
        path = f"/register?{FEATURES_PARAM}={','.join(features)}" if features else "/register"
        resp = await self._post(path, req, RegisterResponse, headers={"Authorization": self._credential})
        self._http.headers["Authorization"] = f"Bearer {resp.node_token}" if resp.node_token else self._credential
        return resp

    async def lease(self, node_id: str, req: LeaseRequest) -> LeaseResponse:
        return await self._post(f"/{node_id}/lease", req, LeaseResponse, timeout=req.wait + self.timeout)

    async def heartbeat(self, node_id: str, hb: Heartbeat | bytes, lease: int | None = None) -> HeartbeatResponse:
        """A beat (a `Heartbeat`, or its body already serialized: `beatbody.beat_body`); `lease`: ask for that
        many leases on the reply (`crds.node.LEASE_PARAM`)."""
        return await self._post(_asking(f"/{node_id}/heartbeat", lease), hb, HeartbeatResponse)

    async def results(self, node_id: str, batch: ResultBatch | list[bytes], lease: int | None = None) -> ResultAck:
        """A `ResultBatch`, or its results already serialized one by one (`result_json`); `lease` as in
        `heartbeat`."""
        path = _asking(f"/{node_id}/results", lease)
        if isinstance(batch, list):
            body = b'{"results":[' + b",".join(batch) + b"]}"
            return await self._post(path, body, ResultAck)
        return await self._post(path, batch, ResultAck)

    async def policy_watch(self, node_id: str, req: PolicyWatch) -> PolicyState:
        """Feature policy-watch: the job's policy once it differs from `req`'s epoch (long-poll up to `req.wait`)."""
        return await self._post(f"/{node_id}/policy-watch", req, PolicyState, timeout=req.wait + self.timeout)

    async def give_back(self, node_id: str, req: ReturnRequest) -> None:
        await self._post(f"/{node_id}/return", req, None)

    async def deregister(self, node_id: str) -> None:
        await self._post(f"/{node_id}/deregister", {}, None, timeout=10.0)
