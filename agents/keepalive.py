"""A small keep-alive HTTP/1.1 transport for httpx: the node's hot paths (LLM calls, the node protocol).

httpx's default pool (httpcore 1.0) rescans every pooled connection — with a syscall each — on every
request, which costs 1–3 ms of CPU per request at the 32–64 connections a daemon keeps to one
backend, and its locks retry a failing `import sniffio` each time. These clients send small bodies
and read whole replies (or, asked with the `"stream"` request extension, a streamed body), so a pool of asyncio streams driven by h11 (httpx's own HTTP/1.1 parser)
does the job. Plain http only: https and a configured proxy stay on httpx's transport (see
`http_proxy_configured`).
"""
from __future__ import annotations

import asyncio
import collections
import time
import urllib.request

import h11
import httpx


class _Conn:
    """One keep-alive HTTP/1.1 connection (asyncio streams + an h11 state machine)."""

    __slots__ = ("reader", "writer", "h11", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0

    def reusable(self, now: float, expiry: float) -> bool:
        """Still open (the server has not closed it while idle) and not idle for too long."""
        return not self.writer.is_closing() and not self.reader.at_eof() and now - self.idle_since < expiry

    def close(self) -> None:
        self.writer.close()


class KeepAliveTransport(httpx.AsyncBaseTransport):
    """A minimal keep-alive connection pool for plain-http requests whose bodies are read whole
    (what `VLLMBackend` sends) or streamed (`VLLMBackend.stream`): one request per connection at a time, idle connections kept per
    origin (at most `max_keepalive`, closed after `keepalive_expiry` s idle: under uvicorn's 5 s),
    at most `max_connections` open. A connection is reused only after a complete exchange; an
    error or a cancellation mid-request closes it (the server sees the disconnect). Errors are
    httpx's (`ConnectError`, `ReadTimeout`, `RemoteProtocolError`, ...), timeouts httpx's
    per-request `connect`/`read`/`write`/`pool` values."""

    def __init__(self, *, max_connections: int = 256, max_keepalive: int = 64, keepalive_expiry: float = 4.0) -> None:
        self.max_keepalive, self.keepalive_expiry = max_keepalive, keepalive_expiry
        self._idle: dict[tuple[str, int], list[_Conn]] = collections.defaultdict(list)
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """The whole reply read at once; with the request extension `"stream": True` the body is read as it comes
        (`Response.aiter_*`; the connection is reused after the body was read to its end and the response closed)."""
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"KeepAliveTransport speaks plain http only, not {url.scheme}://")
        timeouts = request.extensions.get("timeout", {})
        body = await request.aread()
        try:
            async with asyncio.timeout(timeouts.get("pool")):
                await self._slots.acquire()
        except TimeoutError:
            raise httpx.PoolTimeout("no free connection slot", request=request) from None
        origin = (url.host, url.port or 80)
        conn: _Conn | None = None
        held = True  # the slot, until a connection (or the streamed body) takes it over
        try:
            conn = await self._connect(request, origin, timeouts.get("connect"))
            c = conn.h11
            try:
                out = c.send(h11.Request(method=request.method, target=url.raw_path, headers=request.headers.raw))
                if body:
                    out += c.send(h11.Data(data=body))
                out += c.send(h11.EndOfMessage())
            except h11.LocalProtocolError as e:
                raise httpx.LocalProtocolError(str(e), request=request) from None
            conn.writer.write(out)
            try:
                async with asyncio.timeout(timeouts.get("write")):
                    await conn.writer.drain()
            except TimeoutError:
                raise httpx.WriteTimeout("timed out sending the request", request=request) from None
            except OSError as e:
                raise httpx.WriteError(f"{type(e).__name__}: {e}", request=request) from None
            response = await _next_event(conn, request, timeouts, None)
            while not isinstance(response, h11.Response):
                response = await _next_event(conn, request, timeouts, None)
            head = {"headers": response.headers,
                    "extensions": {"http_version": b"HTTP/1.1", "reason_phrase": response.reason}}
            if request.extensions.get("stream"):
                stream = _Body(self, conn, origin, request, timeouts)  # the body releases the slot
                conn, held = None, False
                return httpx.Response(response.status_code, stream=stream, **head)
            chunks = []
            while not isinstance(event := await _next_event(conn, request, timeouts, response), h11.EndOfMessage):
                chunks.append(bytes(event.data))
            self._release(conn, origin)  # frees the slot
            conn, held = None, False
            return httpx.Response(response.status_code, content=b"".join(chunks), **head)
        finally:
            if conn is not None:  # failed or cancelled mid-exchange: never reused
                conn.close()
            if held:  # also when no connection was made (refused, timed out): the slot always comes back
                self._slots.release()

    def _release(self, conn: _Conn, origin: tuple[str, int]) -> None:
        """One exchange is over: its slot freed, the connection kept if the exchange completed."""
        self._slots.release()
        c = conn.h11
        idle = self._idle[origin]
        if c.our_state is h11.DONE and c.their_state is h11.DONE and not self._closed and len(idle) < self.max_keepalive:
            c.start_next_cycle()
            conn.idle_since = time.monotonic()
            idle.append(conn)
        else:
            conn.close()

    async def _connect(self, request: httpx.Request, origin: tuple[str, int], timeout: float | None) -> _Conn:
        idle, now = self._idle[origin], time.monotonic()
        while idle:  # the most recently used first: the least likely to have been closed
            conn = idle.pop()
            if conn.reusable(now, self.keepalive_expiry):
                return conn
            conn.close()
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(*origin, limit=1 << 20)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"timed out connecting to {origin[0]}:{origin[1]}", request=request) from None
        except OSError as e:
            raise httpx.ConnectError(f"{type(e).__name__}: {e}", request=request) from None
        return _Conn(reader, writer)

    async def aclose(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


async def _next_event(conn: _Conn, request: httpx.Request, timeouts: dict, response: object) -> object:
    """The connection's next h11 event (a response, data or the end of the message), reading as needed; the
    errors are httpx's."""
    c = conn.h11
    while True:
        try:
            event = c.next_event()
        except h11.RemoteProtocolError as e:
            raise httpx.RemoteProtocolError(str(e), request=request) from None
        if event is not h11.NEED_DATA:
            if isinstance(event, h11.ConnectionClosed):
                raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
            return event
        try:
            async with asyncio.timeout(timeouts.get("read")):
                data = await conn.reader.read(65536)
        except TimeoutError:
            raise httpx.ReadTimeout("timed out waiting for the response", request=request) from None
        except OSError as e:
            raise httpx.ReadError(f"{type(e).__name__}: {e}", request=request) from None
        if not data and response is None:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        try:
            c.receive_data(data)
        except h11.RemoteProtocolError as e:
            raise httpx.RemoteProtocolError(str(e), request=request) from None


class _Body(httpx.AsyncByteStream):
    """A streamed response body: each chunk as it arrives; closing it returns the connection to the pool (or
    closes it, when the body was not read to its end)."""

    def __init__(self, pool: KeepAliveTransport, conn: _Conn, origin: tuple[str, int], request: httpx.Request,
                 timeouts: dict) -> None:
        self.pool, self.conn, self.origin, self.request, self.timeouts = pool, conn, origin, request, timeouts

    async def __aiter__(self):
        while self.conn is not None:
            event = await _next_event(self.conn, self.request, self.timeouts, True)
            if isinstance(event, h11.EndOfMessage):
                break
            yield bytes(event.data)

    async def aclose(self) -> None:
        conn, self.conn = self.conn, None
        if conn is not None:
            self.pool._release(conn, self.origin)


def http_proxy_configured() -> bool:
    """An http proxy is set in the environment: httpx's own transport honours it, this one does not."""
    proxies = urllib.request.getproxies()
    return bool(proxies.get("http") or proxies.get("all"))
