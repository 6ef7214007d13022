"""Several controller addresses (controller/client/failover.py, agents/daemon/controller_client.py): a request moves
to the next address when one refuses the connection or answers 503 (a follower with no leader), and stays on the
one that answered; the node daemon's client does the same for its next call. Transports are httpx's test seam."""
from __future__ import annotations

import asyncio

import httpx

from rolloutd.agents.daemon.controller_client import ControllerClient, ControllerError
from rolloutd.client.connection import Connection, client_options
from rolloutd.client.failover import AsyncFailover, Failover

SERVERS = ["http://a:7350", "http://b:7350", "http://c:7350"]


def _controllers(log: list[str]):
    def handle(request: httpx.Request) -> httpx.Response:
        log.append(request.url.host)
        if request.url.host == "a":
            raise httpx.ConnectError("refused", request=request)
        if request.url.host == "b":
            return httpx.Response(503, headers={"Retry-After": "1"})
        return httpx.Response(200, json={"host": request.headers["Host"]})
    return handle


def test_a_request_moves_past_a_refusal_and_a_503_then_stays():
    log: list[str] = []
    with httpx.Client(transport=Failover(SERVERS, inner=httpx.MockTransport(_controllers(log))),
                      base_url=SERVERS[0]) as http:
        assert http.get("/version").json() == {"host": "c:7350"}
        assert http.get("/version").status_code == 200
    assert log == ["a", "b", "c", "c"]


def test_every_address_down_is_the_last_ones_answer():
    def handle(request):
        raise httpx.ConnectError("refused", request=request)
    with httpx.Client(transport=Failover(SERVERS[:2], inner=httpx.MockTransport(handle)), base_url=SERVERS[0]) as h:
        try:
            h.get("/version")
        except httpx.ConnectError:
            pass
        else:
            raise AssertionError("no address answered: the error reaches the client's retry")


def test_the_clients_build_a_failover_transport_only_for_several_addresses():
    one = client_options(Connection("http://a:7350", "t", "default", None), 30.0)
    assert "transport" not in one and one["base_url"] == "http://a:7350"
    many = client_options(Connection(",".join(SERVERS), "t", "default", None), 30.0, asynchronous=True)
    assert isinstance(many["transport"], AsyncFailover) and many["base_url"] == SERVERS[0]


def test_the_node_daemon_moves_to_the_next_controller_for_its_next_call():
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        if request.url.host == "a":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={})

    async def go():
        client = ControllerClient("http://a:7350, http://b:7350", "tok", job="j",
                                  transport=httpx.MockTransport(handle))
        assert client.timeout == 10.0  # several addresses: a call that hangs moves on sooner
        try:
            await client.deregister("n1")
        except ControllerError as e:
            assert e.retryable
        await client.deregister("n1")  # the caller's retry reaches b
        await client.aclose()
    asyncio.run(go())
    assert seen == ["a", "b"]
