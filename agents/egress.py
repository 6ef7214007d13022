"""The verifier's way out: an HTTP proxy on a Unix socket that reaches the host's network, for one EVAL.

Where it sits: the harbor handler's EVAL (agents/tasks/harbor.py) starts an `EgressProxy` in the sandbox's
control directory when the job consents (`sandbox.verifierNetwork`) and the task allows the internet, after
every process the agent left has been killed; the gateway's relay (agents/gateway.py `start_relay`) serves it
on the sandbox's own loopback and the verifier's shell gets `http_proxy`/`https_proxy`. It stops with the
verifier: the agent never has it. Next step: the verifier's downloads (uv, pip) go through it.

It speaks what downloaders use: `CONNECT host:port` (https, tunnelled as is) and plain-http requests in
absolute form (`GET http://host:port/path`), forwarded unchanged (servers must accept that form).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from urllib.parse import urlsplit

HEAD_LIMIT = 64 * 1024


class EgressProxy:
    """Serve `path` (a Unix socket) until `stop`: each connection is one proxied TCP connection."""

    def __init__(self) -> None:
        self._server: asyncio.base_events.Server | None = None
        self._conns: set[asyncio.Task] = set()

    async def start(self, path: str | Path) -> None:
        self._server = await asyncio.start_unix_server(self._track, path=str(path), limit=HEAD_LIMIT)
        os.chmod(path, 0o666)  # the sandbox's user, whatever its uid; the 0700 control dir keeps others out

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._conns):
            task.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _track(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._conns.add(task)
        try:
            await self._serve(reader, writer)
        finally:
            self._conns.discard(task)
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            return
        method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
        target = rest.rpartition(" ")[0]
        if method == "CONNECT":
            host, _, port = target.rpartition(":")
            host = host.strip("[]")
        else:
            url = urlsplit(target)
            host, port = url.hostname or "", str(url.port or 80) if url.scheme == "http" else ""
        if not host or not port.isdigit():
            writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 30)
        except (OSError, asyncio.TimeoutError) as e:
            body = f"egress: cannot reach {host}:{port}: {e}\n".encode()
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            return
        if method == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            up_writer.write(head)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            up_writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


__all__ = ["EgressProxy"]
