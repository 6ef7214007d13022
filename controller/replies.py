"""The plain ASGI replies and request-body helpers of a controller replica's node calls and forwarding: 503 + Retry-After,
421 naming a node's owner, a request's body read whole and replayed. Used by `replicas.py`; next step: there.
"""
from __future__ import annotations

import json

from rolloutd.crds.node import MISDIRECTED

from .ha.shards import OWNER

NOT_LEADER = "x-rolloutd-not-leader"  # on a 503 of a follower that knows no leader now


async def unavailable(send, message: str, owner: str = "") -> None:
    """503 + Retry-After: no leader now, or (`owner`) a node call to make to the replica named."""
    body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                       "reason": "ServiceUnavailable", "code": 503}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")]
                + ([(OWNER.encode(), owner.encode())] if owner else [(NOT_LEADER.encode(), b"1")])})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def misdirected(send, node_id: str, owner: str) -> None:
    """421 naming the owner (owner-redirect), nothing of the call processed. Not 307 to its URL: generic clients follow
    one without moving, and it means the resource is elsewhere, where 421 says this server is the wrong one for it."""
    body = json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": MISDIRECTED, "reason":
                       "Misdirected", "message": f"node {node_id} is served by {owner}: send it there"}).encode()
    await send({"type": "http.response.start", "status": MISDIRECTED,
                "headers": [(b"content-type", b"application/json"), (OWNER.encode(), owner.encode())]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def read_body(receive) -> bytes:
    """A request's whole body."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


def replay(body: bytes, receive):
    """An ASGI `receive` that gives `body` (read from `receive` already) once, then what `receive` gives (the
    client's disconnect)."""
    sent = False

    async def again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return again
