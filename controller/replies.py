"""The plain ASGI replies and request-body helpers of a controller replica's node calls and forwarding: 503 + Retry-After,
421 naming a node's owner, a request's body read whole and replayed. Used by `replicas.py`; next step: there.
"""
from __future__ import annotations

import json

from rolloutd.crds.node import MISDIRECTED

from .errors import ApiError, BadRequest, TooLarge
from .ha.shards import OWNER
from .http.node_protocol import RESULTS_MAX_BYTES

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


async def read_body(scope, receive, limit: int = RESULTS_MAX_BYTES) -> bytes:
    """A request's whole body, at most `limit` bytes (the largest any route takes): read before the app's own checks
    (its token's among them), an unbounded read let any client make a replica hold gigabytes; a body the client
    left inside was passed on cut short, as if whole."""
    declared = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), b"")
    if declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"request body is {int(declared)} bytes; the limit is {limit}")
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise BadRequest("the request body did not arrive whole: the connection closed")
        body += message.get("body", b"")
        if len(body) > limit:
            raise TooLarge(f"request body exceeds the limit of {limit} bytes")
        if not message.get("more_body"):
            return bytes(body)


async def refused(send, e: ApiError) -> None:
    """The answer to a body not read whole (`read_body`'s error)."""
    await send({"type": "http.response.start", "status": e.code, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(e.status()).encode(), "more_body": False})


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
