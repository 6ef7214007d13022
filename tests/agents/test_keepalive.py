"""KeepAliveTransport (agents/keepalive.py) against a real HTTP/1.1 server on a TCP socket: connections
are reused only after a complete exchange, and every failure is httpx's error, never a hang."""
from __future__ import annotations

import asyncio
import socket
import struct

import h11
import httpx
import pytest

from rolloutd.agents.keepalive import KeepAliveTransport
from support.waiting import until


class Server:
    """A small asyncio HTTP/1.1 server (h11). Paths: `/ok` answers "ok", `/slow` answers after
    `release` is set, `/close` answers and then closes the connection without saying so, `/parts` sends "one"
    at once and "two" (chunked) after `release` is set, `/reset` resets the connection, `/half` shuts its
    sending side without a reply."""

    def __init__(self, port: int = 0) -> None:
        self.port = port
        self.connections = 0
        self.disconnects = 0
        self.release = asyncio.Event()
        self._server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> "Server":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.release.set()
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await reader.read(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                elif isinstance(event, h11.Request):
                    path = event.target.decode()
                elif isinstance(event, h11.EndOfMessage) and path == "/reset":
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()  # an RST, no reply
                    return
                elif isinstance(event, h11.EndOfMessage) and path == "/half":
                    writer.write_eof()  # half-closed: the server's side ends without a reply
                    await self.release.wait()
                    return
                elif isinstance(event, h11.EndOfMessage) and path == "/parts":
                    writer.write(conn.send(h11.Response(status_code=200, headers=[("transfer-encoding", "chunked")]))
                                 + conn.send(h11.Data(data=b"one")))
                    await writer.drain()
                    await self.release.wait()
                    writer.write(conn.send(h11.Data(data=b"two")) + conn.send(h11.EndOfMessage()))
                    await writer.drain()
                    conn.start_next_cycle()
                elif isinstance(event, h11.EndOfMessage):
                    if path == "/slow":
                        await self.release.wait()
                    body = path.encode()
                    writer.write(conn.send(h11.Response(status_code=200, headers=[("content-length", str(len(body)))]))
                                 + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
                    await writer.drain()
                    if path == "/close":
                        return
                    conn.start_next_cycle()
        except (ConnectionError, h11.RemoteProtocolError):
            pass
        finally:
            self.disconnects += 1
            writer.close()


def client(transport: KeepAliveTransport | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=transport or KeepAliveTransport(), timeout=httpx.Timeout(5.0))


def test_sequential_requests_share_one_connection():
    async def scenario():
        async with Server() as srv, client() as http:
            for _ in range(5):
                r = await http.post(srv.url + "/ok", content=b"x" * 100)
                assert (r.status_code, r.content) == (200, b"/ok")
            assert srv.connections == 1
            # concurrent requests get a connection each, all kept for the next round
            await asyncio.gather(*(http.get(srv.url + "/ok") for _ in range(3)))
            await asyncio.gather(*(http.get(srv.url + "/ok") for _ in range(3)))
            assert srv.connections == 3

    asyncio.run(scenario())


def test_a_connection_the_server_closed_is_not_reused():
    async def scenario():
        transport = KeepAliveTransport()
        async with Server() as srv, client(transport) as http:
            assert (await http.get(srv.url + "/close")).content == b"/close"
            idle = [c for conns in transport._idle.values() for c in conns]
            assert len(idle) == 1  # kept: the server did not say it would close
            await until(lambda: idle[0].reader.at_eof(), 5, "the server's close seen by the idle connection")
            assert (await http.get(srv.url + "/ok")).content == b"/ok"
            assert srv.connections == 2

    asyncio.run(scenario())


def test_a_read_timeout_is_httpx_s_and_closes_the_connection():
    async def scenario():
        async with Server() as srv, client() as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.get(srv.url + "/slow", timeout=0.2)
            assert (await http.get(srv.url + "/ok")).content == b"/ok"
            assert srv.connections == 2  # the timed-out one was not handed out again

    asyncio.run(scenario())


def test_a_cancelled_request_disconnects_so_the_server_sees_it():
    async def scenario():
        async with Server() as srv, client() as http:
            task = asyncio.ensure_future(http.get(srv.url + "/slow"))
            await until(lambda: srv.connections, 5, "the request at the server")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            srv.release.set()  # the server answers, then reads the next request: end of stream
            await until(lambda: srv.disconnects, 5, "the server to see the disconnect")
            assert (await http.get(srv.url + "/ok")).content == b"/ok"

    asyncio.run(scenario())


def test_unreachable_server_and_https_are_clear_errors():
    async def scenario():
        async with Server() as srv:
            url = srv.url
        async with client() as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(url + "/ok")
            with pytest.raises(httpx.UnsupportedProtocol, match="plain http"):
                await http.get("https://127.0.0.1:9/ok")

    asyncio.run(scenario())


def test_a_streamed_body_comes_as_it_is_sent_and_its_connection_is_reused_once_read():
    """The "stream" request extension (VLLMBackend.stream): the first part is read while the server still holds
    the second; read to its end and closed, the connection goes back to the pool; closed mid-body, it is closed."""
    async def scenario():
        transport = KeepAliveTransport()
        async with Server() as srv:
            async def stream():
                request = httpx.Request("GET", srv.url + "/parts", extensions={"stream": True, "timeout": {}})
                return await transport.handle_async_request(request)
            r = await stream()
            parts = r.aiter_raw()
            assert await parts.__anext__() == b"one"  # the server holds "two" until released
            srv.release.set()
            assert [p async for p in parts] == [b"two"]
            await r.aclose()
            srv.release.clear()
            r = await stream()
            assert srv.connections == 1  # reused
            assert await r.aiter_raw().__anext__() == b"one"
            await r.aclose()  # mid-body: the connection is closed, not reused
            srv.release.set()  # the server sends the rest, then reads: end of stream
            await until(lambda: srv.disconnects, 5, "the server to see the disconnect")
            r = await stream()
            assert srv.connections == 2 and [p async for p in r.aiter_raw()] == [b"one", b"two"]
            await r.aclose()
            await transport.aclose()

    asyncio.run(scenario())


def free_slots(transport: KeepAliveTransport) -> int:
    return transport._slots._value


def test_refused_connects_give_their_slots_back_and_the_n_plus_first_call_succeeds():
    """More refused connects than the pool has slots (a controller or backend restarting), then the server is
    back on the same port: the next call succeeds and every slot is free again."""
    async def scenario():
        transport = KeepAliveTransport(max_connections=2)
        async with Server() as srv:
            port = int(srv.url.rsplit(":", 1)[1])
        async with client(transport) as http:
            for _ in range(5):
                with pytest.raises(httpx.ConnectError):
                    await http.get(f"http://127.0.0.1:{port}/ok", timeout=httpx.Timeout(2.0, pool=0.5))
            assert free_slots(transport) == 2
            async with Server(port) as srv:
                assert (await http.get(srv.url + "/ok")).content == b"/ok"
            assert free_slots(transport) == 2

    asyncio.run(scenario())


def test_a_connect_timeout_gives_its_slot_back():
    """A listener whose accept queue is full drops the SYN: the connect times out (httpx's ConnectTimeout)."""
    async def scenario():
        transport = KeepAliveTransport(max_connections=1)
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(0)
            port = listener.getsockname()[1]
            fillers = []
            try:  # fill the accept queue (never accepted) until a connect no longer completes at once
                for _ in range(8):
                    s = socket.socket()
                    s.settimeout(0.2)
                    fillers.append(s)
                    try:
                        s.connect(("127.0.0.1", port))
                    except (TimeoutError, OSError):
                        break
                async with client(transport) as http:
                    for _ in range(3):
                        with pytest.raises(httpx.ConnectTimeout):
                            await http.get(f"http://127.0.0.1:{port}/ok", timeout=httpx.Timeout(5.0, connect=0.2))
                    assert free_slots(transport) == 1
            finally:
                for s in fillers:
                    s.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("path, errors, read", [
    # A reset or a half-close comes at once; the read timeout is long so that a loaded machine's scheduling delay
    # is not mistaken for the timeout that only /slow is about.
    ("/reset", (httpx.ReadError, httpx.RemoteProtocolError), 10.0),
    ("/half", (httpx.RemoteProtocolError,), 10.0),
    ("/slow", (httpx.ReadTimeout,), 0.3),
])
def test_reset_half_closed_and_timed_out_exchanges_give_their_slots_back(path, errors, read):
    async def scenario():
        transport = KeepAliveTransport(max_connections=2)
        async with Server() as srv, client(transport) as http:
            for _ in range(3):  # more failures than slots
                with pytest.raises(errors):
                    await http.get(srv.url + path, timeout=httpx.Timeout(read, pool=0.5))
            assert free_slots(transport) == 2
            srv.release.set()
            assert (await http.get(srv.url + "/ok")).content == b"/ok"
            assert free_slots(transport) == 2

    asyncio.run(scenario())


def test_the_clients_of_an_engine_drop_an_idle_connection_before_the_engine_would():
    """vLLM's server closes a connection idle for 5 s; a call sent on it just then fails ("Server disconnected").
    The node's engine client and the controller's (weight updates, minutes apart) open a new one after 4 s idle."""
    from rolloutd.agents.vllm_backend import VLLMBackend
    from rolloutd.controller.work.backend_http import BackendHttp
    from rolloutd.crds.node import ENGINE_CLIENT_KEEP_ALIVE_SECONDS

    async def twice(call) -> int:
        async with Server() as srv:
            await call(srv.url)
            await call(srv.url)
            assert srv.connections == 1  # back to back: one connection
            await asyncio.sleep(ENGINE_CLIENT_KEEP_ALIVE_SECONDS + 0.2)  # idle past ours, short of the engine's 5 s
            await call(srv.url)
            return srv.connections

    async def scenario():
        node = VLLMBackend("http://127.0.0.1:1")
        admin = BackendHttp()

        async def by_node(url: str) -> None:
            node.url = url
            assert (await node._request("GET", "/ok")).status_code == 200

        async def by_controller(url: str) -> None:
            assert await admin.post(url, "/ok") is None
        try:
            return await asyncio.gather(twice(by_node), twice(by_controller))
        finally:
            await node.aclose()
            await admin.client.aclose()
    assert ENGINE_CLIENT_KEEP_ALIVE_SECONDS < 5
    assert asyncio.run(scenario()) == [2, 2]
