"""A small keep-alive HTTP/1.1 transport for httpx: the node's hot paths (LLM calls, the node protocol).

httpx's default pool (httpcore 1.0) rescans every pooled connection — with a syscall each — on every
request, which costs 1–3 ms of CPU per request at the 32–64 connections a daemon keeps to one
backend, and its locks retry a failing `import sniffio` each time. These clients send small bodies
and read whole replies, so a pool of asyncio streams driven by h11 (httpx's own HTTP/1.1 parser)
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
    (what `VLLMBackend` sends): one request per connection at a time, idle connections kept per
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
        conn: _Conn | None = None
        reusable = False
        try:
            conn = await self._connect(request, (url.host, url.port or 80), timeouts.get("connect"))
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
            response, chunks = None, []
            while True:
                try:
                    event = c.next_event()
                except h11.RemoteProtocolError as e:
                    raise httpx.RemoteProtocolError(str(e), request=request) from None
                if event is h11.NEED_DATA:
                    try:
                        async with asyncio.timeout(timeouts.get("read")):
                            data = await conn.reader.read(65536)
                    except TimeoutError:
                        raise httpx.ReadTimeout("timed out waiting for the response", request=request) from None
                    except OSError as e:
                        raise httpx.ReadError(f"{type(e).__name__}: {e}", request=request) from None
                    if not data and response is None:
                        raise httpx.RemoteProtocolError("Server disconnected without sending a response.",
                                                        request=request)
                    try:
                        c.receive_data(data)
                    except h11.RemoteProtocolError as e:
                        raise httpx.RemoteProtocolError(str(e), request=request) from None
                elif isinstance(event, h11.Response):
                    response = event
                elif isinstance(event, h11.Data):
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise httpx.RemoteProtocolError("Server disconnected without sending a response.",
                                                    request=request)
            reusable = c.our_state is h11.DONE and c.their_state is h11.DONE
            if reusable:
                c.start_next_cycle()
        finally:
            self._slots.release()
            if conn is not None:
                idle = self._idle[(url.host, url.port or 80)]
                if reusable and not self._closed and len(idle) < self.max_keepalive:
                    conn.idle_since = time.monotonic()
                    idle.append(conn)
                else:
                    conn.close()
        assert response is not None
        return httpx.Response(response.status_code, headers=response.headers, content=b"".join(chunks),
                              extensions={"http_version": b"HTTP/1.1", "reason_phrase": response.reason})

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


def http_proxy_configured() -> bool:
    """An http proxy is set in the environment: httpx's own transport honours it, this one does not."""
    proxies = urllib.request.getproxies()
    return bool(proxies.get("http") or proxies.get("all"))
