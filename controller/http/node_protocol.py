"""The node-daemon protocol: thin routes over the work core's node parts (registry, attempts, node calls).

    POST /apis/rolloutd.io/v1alpha1/namespaces/{ns}/rolloutjobs/{name}/nodes/register (`?features=…`) | /{node}/lease
         | /{node}/heartbeat | /{node}/results | /{node}/return | /{node}/deregister | /{node}/policy-watch
         register: the job's node credential (its job only) or the admin token; the rest: the node's own token
         (`nodeauth.py`, checked in the API middleware before these routes run) or the admin token
         (heartbeat and results take `?lease=N`: leases ride on the reply, `crds.node.LEASE_PARAM`)
    POST …/namespaces/{ns}/rolloutjobs/{name}/nodes/credential   the job's node credential, for daemons started by
         hand (admin token only: the middleware lets no other token through here; revoked on the job's release)
    POST /apis/rolloutd.io/v1alpha1/nodes/…   the same, for daemons of the previous version (job in `default`
         unless the register body's job is a "namespace/name" key); node ids are unique across jobs

Mounted by `api.create_app` when the root has a work core: a call goes route → `work.node_registry.NodeRegistry`,
`work.attempts.Attempts` or `work.node_calls.NodeCalls` (a beat or results in a grouped transaction) →
`Attempts`, which reads the node's row once, in the call's transaction. Wire models:
`rolloutd.crds.node`; the daemon's side is `rolloutd.agents.daemon.controller_client`.
"""
from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel

from rolloutd.crds.names import API_PREFIX, job_key, split_key
from rolloutd.crds.node import (FEATURES_PARAM, NODE_TOKEN, REPLY_FIELDS, Heartbeat, LeaseRequest, PolicyWatch,
                                RegisterRequest, ResultBatch, ReturnRequest)

from ..errors import BadRequest, Conflict, Forbidden, NotFound
from ..access.nodeauth import NodeCredentials
from ..work.attempts import Attempts
from ..work.job_state import Jobs, closed
from ..work.node_calls import NodeCalls
from ..work.node_registry import NodeRegistry
from .bodies import read_model, read_model_fast

# Trajectory reports can be large (a long SWE rollout: ~32k tokens with logprobs and messages).
RESULTS_MAX_BYTES = 64 << 20
MAX_LEASE = 1 << 16  # `?lease=N`: a node's free slots
NODES = f"{API_PREFIX}/nodes"
JOB_NODES = f"{API_PREFIX}/namespaces/{{namespace}}/rolloutjobs/{{name}}/nodes"


# reply fields that only go to a daemon that asked for them (`?lease=N`, `?features=…`): an older one does not
# know them, and its models refuse unknown fields (a registration's policy is sent when there is one: an older
# daemon then refuses the reply, and so never runs a restricted job unchecked)
ASKED_ONLY = ("lease", "features", "accepted", "dropped", "beat_gap", "node_token", "policy", "policy_name", "job_uid")


def _ok(model: BaseModel, features: frozenset[str] | None = None) -> Response:
    """`model` as JSON without the fields the caller did not ask for: the ASKED_ONLY ones it left None and, for a
    node's call, those of the features it did not declare at registration (`crds.node.REPLY_FIELDS`)."""
    exclude: dict = {f: True for f in ASKED_ONLY if f in type(model).model_fields and getattr(model, f) is None}
    if features is not None:
        for feature, fields in REPLY_FIELDS.items():
            if feature not in features:
                for owner, field in fields:
                    _exclude(exclude, model, owner, field)
    return Response(model.model_dump_json(by_alias=True, exclude=exclude or None), media_type="application/json")


def _exclude(spec: dict, model: BaseModel, owner: str, field: str) -> None:
    """Add to `spec` (pydantic's nested `exclude`) `owner.field` wherever it sits in `model`'s replies: the reply
    itself, its leases, the leases riding on it (`?lease=N`)."""
    if type(model).__name__ == owner:
        spec[field] = True
    elif owner == "Lease" and hasattr(model, "leases"):
        spec["leases"] = {"__all__": {field: True}}
    elif owner == "Lease" and getattr(model, "lease", None) is not None and spec.get("lease") is not True:
        spec["lease"] = {"leases": {"__all__": {field: True}}}


def _features(request: Request) -> list[str] | None:
    """`?features=a,b` of a register call (None: not asked)."""
    raw = request.query_params.get(FEATURES_PARAM)
    return None if raw is None else [f for f in raw.split(",") if f]


def _owned(registry: NodeRegistry, node_id: str, request: Request) -> str:
    """`node_id`, once sure it belongs to the rolloutjob of a namespaced path: a namespace token reaches the
    namespaced paths of its own namespace, and must not act on another namespace's node by naming its id."""
    path = request.path_params
    if "namespace" in path:
        job = registry.job_of(node_id)
        if job is not None and job != job_key(path["namespace"], path["name"]):
            raise NotFound(f"node {node_id} is not a node of rolloutjob {path['namespace']}/{path['name']}")
    return node_id


async def _nothing() -> None:
    """No store to sync (a router built without one)."""


def node_router(jobs: Jobs, registry: NodeRegistry, attempts: Attempts, calls: NodeCalls,
                credentials: NodeCredentials, settle: Callable[[], Awaitable[None]] | None = None) -> APIRouter:
    """`settle`: returns once the commits made so far are on the disk (`durability.Durable.settle`): a node is
    told its results are stored only then (it forgets them on that answer); beats and leases do not wait for it."""
    r = APIRouter()
    settled = settle or _nothing

    def admit(req: RegisterRequest, request: Request) -> Response:
        """Register `req` (its job resolved): a job credential only for its own job, and only as a node that
        takes a token of its own (feature node-token), so it never acts as another node."""
        features = _features(request)
        job = getattr(request.state, "node_job", None)  # None: the admin token
        req.job = job_key(*split_key(req.job))
        if job is not None and req.job != job:
            raise Forbidden(f"this node credential is rolloutjob {job}'s: it cannot register for {req.job}")
        if job is not None and not credentials.minted_for(jobs.get(job)):
            raise Forbidden(f"this node credential was minted for an earlier rolloutjob {job}")
        if job is not None and NODE_TOKEN not in (features or ()):
            raise BadRequest(f"each node gets a token of its own: ask for feature {NODE_TOKEN!r} "
                             "(run the same rolloutd version on the controller and the nodes)")
        resp = registry.register(req, features)
        if NODE_TOKEN in (resp.features or ()):
            token = credentials.node_token(resp.job, resp.node_id)
            if token is None:  # the admin registering for a job whose daemons no executor started
                credentials.mint(jobs.get(resp.job))
                token = credentials.node_token(resp.job, resp.node_id)
            resp.node_token = token
        return _ok(resp)

    @r.post(f"{JOB_NODES}/credential")
    async def credential(namespace: str, name: str):
        job = jobs.get(job_key(namespace, name))
        if closed(job):
            raise Conflict(f'rolloutjobs "{job.metadata.key}" is {job.status.phase.value}; it takes no more nodes',
                           name=job.metadata.key)
        return {"credential": credentials.mint(job)}

    @r.post(f"{JOB_NODES}/register")
    async def register_namespaced(namespace: str, name: str, request: Request):
        req = await read_model(request, RegisterRequest)
        if split_key(req.job) not in ((namespace, name), ("default", name)):
            raise BadRequest(f"the body's job {req.job!r} is not the path's rolloutjob {namespace}/{name}")
        req.job = job_key(namespace, name)
        return admit(req, request)

    @r.post(f"{NODES}/register")
    async def register(request: Request):
        return admit(await read_model(request, RegisterRequest), request)

    for prefix in (JOB_NODES, NODES):  # a node id names its job; a namespaced path must name the same one
        @r.post(f"{prefix}/{{node_id}}/lease")
        async def lease(node_id: str, request: Request):
            req = await read_model_fast(request, LeaseRequest)
            return _ok(await attempts.lease(_owned(registry, node_id, request), req.max_items, req.wait),
                       registry.features_of(node_id))

        @r.post(f"{prefix}/{{node_id}}/heartbeat")
        async def heartbeat(node_id: str, request: Request, lease: int | None = Query(None, ge=0, le=MAX_LEASE)):
            hb = await read_model_fast(request, Heartbeat, RESULTS_MAX_BYTES)  # it may carry results
            answer = await calls.heartbeat_grouped(_owned(registry, node_id, request), hb, lease)
            if hb.results:  # the node's next beat waits for this answer: its leases wait with it
                with attempts.held.answering(node_id, answer.lease_seconds):
                    await settled()
            return _ok(answer, registry.features_of(node_id))

        @r.post(f"{prefix}/{{node_id}}/results")
        async def results(node_id: str, request: Request, lease: int | None = Query(None, ge=0, le=MAX_LEASE)):
            batch = await read_model_fast(request, ResultBatch, RESULTS_MAX_BYTES)
            answer = await calls.results_grouped(_owned(registry, node_id, request), batch, lease)
            await settled()
            return _ok(answer, registry.features_of(node_id))

        @r.post(f"{prefix}/{{node_id}}/return")
        async def give_back(node_id: str, request: Request):
            req = await read_model(request, ReturnRequest)
            return {"returned": attempts.give_back(_owned(registry, node_id, request), req.attempt_ids, req.reason)}

        @r.post(f"{prefix}/{{node_id}}/policy-watch")
        async def policy_watch(node_id: str, request: Request):
            req = await read_model(request, PolicyWatch)
            job = registry.job_of(_owned(registry, node_id, request))
            if job is None:
                raise NotFound(f"node {node_id} is not registered")
            return _ok(await attempts.policy.watch(node_id, job, req))

        @r.post(f"{prefix}/{{node_id}}/deregister")
        async def deregister(node_id: str, request: Request):
            registry.deregister(_owned(registry, node_id, request))
            return {}

    return r
