"""Feature owner-redirect, the daemon's side (agents/daemon/controller_client.py), against a real HTTP server: a 421
names the node's owner and the call is re-sent there; an owner that gives no answer (a killed replica) sends the call
back to the replica that named it, saying so (UNREACHABLE_HEADER), and the daemon stays with that replica."""
from __future__ import annotations

import asyncio
import json

import pytest

from rolloutd.agents.daemon.controller_client import ControllerClient, ControllerError
from rolloutd.crds.node import MISDIRECTED, OWNER_HEADER, UNREACHABLE_HEADER, Heartbeat
from support.cluster import free_port
from support.serve_thread import ThreadServer


class Replica:
    """A replica whose node calls it does not own: 421 naming `owner`, unless the call says `owner` gave no answer
    (then it took the node over and answers) — or never, as a controller that does not know the header."""

    def __init__(self, owner: str, takes_over: bool = True) -> None:
        self.owner, self.takes_over = owner, takes_over
        self.told: list[str | None] = []  # each call's UNREACHABLE_HEADER (None: absent)

    async def __call__(self, scope, receive, send) -> None:
        while (await receive()).get("more_body"):
            pass
        told = dict(scope["headers"]).get(UNREACHABLE_HEADER.encode())
        self.told.append(told.decode() if told is not None else None)
        if self.takes_over and told is not None and told.decode() == self.owner:
            status, headers, body = 200, [], b"{}"
        else:
            status, headers = MISDIRECTED, [(OWNER_HEADER.encode(), self.owner.encode())]
            body = json.dumps({"code": MISDIRECTED, "message": f"served by {self.owner}"}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), *headers]})
        await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize("takes_over", [True, False])
def test_a_call_whose_named_owner_gives_no_answer_goes_back_saying_so_and_stays(takes_over):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: a killed replica
    replica, port = Replica(dead, takes_over), free_port()
    server = ThreadServer(replica, port, "replica").start()
    url = f"http://127.0.0.1:{port}"

    async def beats():  # three at once, as a daemon's beat, lease and watch calls are: each keeps to its own way
        client = ControllerClient(url, "t", job="default/j")

        async def beat():
            try:
                await client.heartbeat("n1", Heartbeat())
            except ControllerError as e:
                return e
        try:
            return await asyncio.gather(beat(), beat(), beat()), client.base_url
        finally:
            await client.aclose()

    try:
        errors, at = asyncio.run(beats())
    finally:
        server.stop()
    # each told once that the owner it named gave no answer, none sent there again
    assert sorted(replica.told, key=str) == sorted([None, dead] * 3, key=str), replica.told
    assert at == url  # the daemon's next calls go to the replica that answers, not to the dead owner
    if takes_over:
        assert errors == [None] * 3
    else:  # a controller that does not know the header: the call fails (retryable), the daemon still stays
        assert all(e is not None and e.status == MISDIRECTED and e.retryable for e in errors), errors
