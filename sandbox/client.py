"""Async client of the in-sandbox execution server (node side).

Where it sits: `Sandbox` (sandbox.py) owns one `ExecClient` per sandbox and calls
`call()` with a request model from `protocol.py`; the server's end is `server/wire.py`. One Unix-socket connection
carries every request (length-prefixed marshal: node → server is the trusted
direction) and every reply (JSON lines, parsed with json because they come out
of the sandbox). Each request carries an id and its reply is matched by that id,
so concurrent calls (a ``bash`` still running while ``send_input`` feeds it)
never receive each other's answers. When the connection ends every pending
and future call fails with `SandboxDied`.

The connection is an asyncio `Protocol`, not a stream reader: a reply resolves
its caller's future in the same event-loop turn that reads it (two loop turns
per call instead of four; a builtin's round trip is ~0.4 ms, so this shows).
"""
from __future__ import annotations

import asyncio
import itertools
import json
import marshal
import select
from typing import Any

from .errors import ExecError, SandboxDied, SandboxError, SandboxTimeout
from .host.unixsock import connected
from .protocol import RequestModel

LINE_LIMIT = 256 * 1024 * 1024  # largest reply line (a big read_file)
_HANGUP = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)


class ExecClient(asyncio.Protocol):
    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._partial: list[bytes] = []  # the reply line being received, in pieces
        self._partial_size = 0
        self.closed_reason: str | None = None

    @classmethod
    async def connect(cls, path: str) -> "ExecClient":
        sock = await connected(path)  # the sandbox's ctl/exec.sock: a deep sandbox directory makes it long
        _, client = await asyncio.get_running_loop().create_unix_connection(cls, sock=sock)
        return client

    def hung_up(self) -> bool:
        """The server's end of the connection is gone (or ours is closed), by a poll() of the
        socket: no round trip, and true even before the event loop has seen the hang-up."""
        sock = self._transport.get_extra_info("socket") if self._transport else None
        fd = sock.fileno() if sock is not None else -1
        if fd < 0:
            return True
        poller = select.poll()
        poller.register(fd, select.POLLIN | _HANGUP)
        return any(ev & _HANGUP for _, ev in poller.poll(0))

    async def call(self, request: RequestModel, timeout: float | None = None) -> dict[str, Any]:
        """Send one request and wait for its reply; `timeout` is an infrastructure deadline."""
        if self.closed_reason is not None:
            raise SandboxDied(self.closed_reason)
        rid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        payload = request.model_dump()
        payload["id"] = rid
        frame = marshal.dumps(payload)
        try:
            self._transport.write(len(frame).to_bytes(4, "big") + frame)
            if timeout is None:
                reply = await fut
            else:
                try:
                    async with asyncio.timeout(timeout):
                        reply = await fut
                except TimeoutError:
                    raise SandboxTimeout(f"no reply to {request.op!r} within {timeout:.1f}s") from None
        finally:
            self._pending.pop(rid, None)
        err = reply.get("error")
        if err is not None:
            if err.get("type") == "ExecError":
                raise ExecError(err.get("message", ""))
            raise SandboxError(f"execution server error: {err.get('message')}")
        return reply["result"]

    # -- asyncio.Protocol ----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            end = data.find(b"\n")
            while end != -1:
                if self._partial:
                    line = b"".join(self._partial) + data[:end]
                    self._partial.clear()
                    self._partial_size = 0
                else:
                    line = data[:end]
                reply = json.loads(line)
                if not isinstance(reply, dict):
                    raise ValueError(f"a reply is not an object: {line[:80]!r}")
                self._resolve(reply)
                data = data[end + 1 :]
                end = data.find(b"\n")
            if data:
                self._partial.append(data)
                self._partial_size += len(data)
                if self._partial_size > LINE_LIMIT:
                    raise ValueError(f"a reply line is longer than {LINE_LIMIT} bytes")
        except ValueError as e:  # includes json's decode error
            self._fail_all(f"connection to the execution server failed: {e}")
            self._transport.close()

    def _resolve(self, reply: dict[str, Any]) -> None:
        fut = self._pending.get(reply.get("id"))
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            self._fail_all(f"connection to the execution server failed: {exc}")
        self._fail_all("the execution server closed the connection")

    # -- ending ---------------------------------------------------------------------
    def _fail_all(self, reason: str) -> None:
        if self.closed_reason is None:
            self.closed_reason = reason
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(SandboxDied(self.closed_reason))
        self._pending.clear()

    def mark_dead(self, reason: str) -> None:
        """The sandbox is known to be gone (e.g. its process exited): fail calls with this reason."""
        self._fail_all(reason)

    def close_nowait(self) -> None:
        self._fail_all("the sandbox was closed")
        if self._transport is not None:
            self._transport.close()

    async def close(self) -> None:
        self.close_nowait()
        await asyncio.sleep(0)  # let the transport's close run (it is scheduled, not done in place)
