"""Async client of the in-sandbox execution server (node side).

Where it sits: `Sandbox` (base.py) owns one `ExecClient` per sandbox and calls
`call()` with a request model from `models.py`. One Unix-socket connection
carries every request (length-prefixed marshal: node → server is the trusted
direction) and every reply (JSON lines, parsed with json because they come out
of the sandbox). Each request carries an id and its reply is matched by that id,
so concurrent calls (a ``bash`` still running while ``send_input`` feeds it)
never receive each other's answers. When the connection ends every pending
and future call fails with `SandboxDied`.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import marshal
from typing import Any

from .errors import ExecError, SandboxDied, SandboxError, SandboxTimeout
from .models import _Req

LINE_LIMIT = 256 * 1024 * 1024  # largest reply line (a big read_file)


class ExecClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.closed_reason: str | None = None
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect(cls, path: str) -> "ExecClient":
        reader, writer = await asyncio.open_unix_connection(path, limit=LINE_LIMIT)
        return cls(reader, writer)

    async def call(self, request: _Req, timeout: float | None = None) -> dict[str, Any]:
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
            self._writer.write(len(frame).to_bytes(4, "big") + frame)
            try:
                reply = await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                raise SandboxTimeout(f"no reply to {request.op!r} within {timeout:.1f}s") from None
        finally:
            self._pending.pop(rid, None)
        err = reply.get("error")
        if err is not None:
            if err.get("type") == "ExecError":
                raise ExecError(err.get("message", ""))
            raise SandboxError(f"execution server error: {err.get('message')}")
        return reply["result"]

    async def _read_loop(self) -> None:
        reason = "the execution server closed the connection"
        try:
            while True:
                line = await self._reader.readline()
                if not line:
                    break
                reply = json.loads(line)
                fut = self._pending.get(reply.get("id"))
                if fut is not None and not fut.done():
                    fut.set_result(reply)
        except (OSError, ValueError, asyncio.LimitOverrunError) as e:
            reason = f"connection to the execution server failed: {e}"
        except asyncio.CancelledError:
            reason = "the client was closed"
        self._fail_all(reason)

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
        self._task.cancel()
        self._writer.close()

    async def close(self) -> None:
        self.close_nowait()
        try:
            await self._writer.wait_closed()
        except (OSError, ConnectionError):
            pass
