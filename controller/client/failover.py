"""Several controller addresses for one client (`server: "http://a:7350,http://b:7350"`, ROLLOUTD_SERVER the same):
httpx transports that send each request to the address that answered last, and move to the next one when a
request could not be sent there (refused, unreachable) or was answered 503 (a follower with no leader, a
controller stopping). Built by `connection.client_options`; the clients' `Retry` handles what is left (a request
sent and lost: retried on the next address, since the transport moved on).
"""
from __future__ import annotations

import httpx

NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)


class _Rotation:
    def __init__(self, servers: list[str]) -> None:
        self.urls = [httpx.URL(s) for s in servers]
        self.at = 0

    def point(self, request: httpx.Request) -> None:
        base = self.urls[self.at]
        request.url = request.url.copy_with(scheme=base.scheme, host=base.host, port=base.port)
        request.headers["Host"] = base.netloc.decode("ascii")

    def next(self) -> None:
        self.at = (self.at + 1) % len(self.urls)


class Failover(httpx.BaseTransport):
    """`inner`: the transport that sends (a test seam; httpx's own by default)."""

    def __init__(self, servers: list[str], inner: httpx.BaseTransport | None = None, **kw) -> None:
        self.rotation, self.inner = _Rotation(servers), inner or httpx.HTTPTransport(**kw)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for tried in range(1, len(self.rotation.urls) + 1):
            self.rotation.point(request)
            try:
                resp = self.inner.handle_request(request)
            except NOT_SENT:
                self.rotation.next()
                if tried == len(self.rotation.urls):
                    raise
                continue
            except httpx.TransportError:
                self.rotation.next()  # sent and lost: the caller's retry goes to the next address
                raise
            if resp.status_code != 503 or tried == len(self.rotation.urls):
                return resp
            resp.close()
            self.rotation.next()
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.inner.close()


class AsyncFailover(httpx.AsyncBaseTransport):
    def __init__(self, servers: list[str], **kw) -> None:
        self.rotation, self.inner = _Rotation(servers), httpx.AsyncHTTPTransport(**kw)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        for tried in range(1, len(self.rotation.urls) + 1):
            self.rotation.point(request)
            try:
                resp = await self.inner.handle_async_request(request)
            except NOT_SENT:
                self.rotation.next()
                if tried == len(self.rotation.urls):
                    raise
                continue
            except httpx.TransportError:
                self.rotation.next()
                raise
            if resp.status_code != 503 or tried == len(self.rotation.urls):
                return resp
            await resp.aclose()
            self.rotation.next()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await self.inner.aclose()
