"""The node-daemon protocol: thin routes over the scheduler's node methods.

    POST /apis/rolloutd.io/v1alpha1/nodes/register | /{node}/lease | /{node}/heartbeat
         | /{node}/results | /{node}/return | /{node}/deregister       (join token or admin token)

Mounted by `api.create_app` when a scheduler is given; the scheduler does the work. Wire models:
`rolloutd.crds.node`; the daemon's side is `rolloutd.agents.daemon.controller_client`.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from rolloutd.crds.names import API_PREFIX
from rolloutd.crds.node import Heartbeat, LeaseRequest, RegisterRequest, ResultBatch, ReturnRequest

from ..work.scheduler import Scheduler
from .bodies import read_model

# Trajectory reports can be large (a long SWE rollout: ~32k tokens with logprobs and messages).
RESULTS_MAX_BYTES = 64 << 20
NODES = f"{API_PREFIX}/nodes"


def _ok(model: BaseModel) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json", by_alias=True))


def node_router(scheduler: Scheduler) -> APIRouter:
    r = APIRouter()

    @r.post(f"{NODES}/register")
    async def register(request: Request):
        return _ok(scheduler.register(await read_model(request, RegisterRequest)))

    @r.post(f"{NODES}/{{node_id}}/lease")
    async def lease(node_id: str, request: Request):
        req = await read_model(request, LeaseRequest)
        return _ok(await scheduler.lease(node_id, req.max_items, req.wait))

    @r.post(f"{NODES}/{{node_id}}/heartbeat")
    async def heartbeat(node_id: str, request: Request):
        return _ok(scheduler.heartbeat(node_id, await read_model(request, Heartbeat)))

    @r.post(f"{NODES}/{{node_id}}/results")
    async def results(node_id: str, request: Request):
        return _ok(scheduler.results(node_id, await read_model(request, ResultBatch, RESULTS_MAX_BYTES)))

    @r.post(f"{NODES}/{{node_id}}/return")
    async def give_back(node_id: str, request: Request):
        req = await read_model(request, ReturnRequest)
        return {"returned": scheduler.give_back(node_id, req.attempt_ids, req.reason)}

    @r.post(f"{NODES}/{{node_id}}/deregister")
    async def deregister(node_id: str):
        scheduler.deregister(node_id)
        return {}

    return r
