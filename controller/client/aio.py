"""`AsyncRolloutClient`: the asyncio twin of `sync.RolloutClient` — the same methods, as
coroutines (and async iterators for `trajectories`, `iter_groups`, `watch`), for trainers whose
loop is async. Requests come from `core.Calls`, shared with the sync client.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, AsyncIterator

import httpx

from .batch import Batch, Group
from .core import (
    POLL_SLICE_SECONDS, STREAM_RETRIES, Call, Calls, Connection, ConnectionFailed, GroupAssembler, JobEnded, NotFound,
    SSEParser, WaitTimeout, client_options, condition_met, resolve, status_error, trajectory_line, unreachable,
)


class AsyncRolloutClient:
    """See `RolloutClient`; use as `async with AsyncRolloutClient() as rc: ...`."""

    def __init__(self, server: str | None = None, *, token: str | None = None, token_file: str | Path | None = None,
                 connection: Connection | None = None, timeout: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.conn = connection or resolve(server, token_file, token)
        self.http = httpx.AsyncClient(**client_options(self.conn, timeout), transport=transport)
        self.retry_backoff = 0.2
        self._pending: dict[str, int] = {}

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> "AsyncRolloutClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ------------------------------------------------------------ plumbing

    async def _do(self, call: Call) -> Any:
        try:
            r = await self.http.request(call.method, call.path, **call.kwargs())
        except httpx.TransportError as e:
            raise unreachable(self.conn.server, e) from None
        if r.status_code >= 400:
            raise status_error(r)
        return call.result(r)

    async def _backoff(self, failures: int, what: str, e: Exception) -> None:
        if failures > STREAM_RETRIES:
            raise ConnectionFailed(f"{what} from {self.conn.server} keeps failing: {e}") from None
        await asyncio.sleep(min(self.retry_backoff * 2 ** (failures - 1), 5.0))

    # ------------------------------------------------------------ jobs

    async def apply(self, job: dict[str, Any] | str | Path) -> dict[str, Any]:
        return (await self._do(Calls.apply(job)))[0]

    async def apply_with_outcome(self, job: dict[str, Any] | str | Path) -> tuple[dict[str, Any], str]:
        return await self._do(Calls.apply(job))

    async def get(self, name: str) -> dict[str, Any]:
        return await self._do(Calls.get(name))

    async def list(self, selector: str | None = None) -> dict[str, Any]:
        return await self._do(Calls.list(selector))

    async def events(self, name: str) -> list[dict[str, Any]]:
        return await self._do(Calls.events(name))

    async def delete(self, name: str, wait: bool = False, timeout: float | None = None) -> dict[str, Any]:
        obj = await self._do(Calls.delete(name))
        if wait:
            try:
                async for type_, _obj, _ in self.watch(name, since=obj["metadata"]["resourceVersion"],
                                                       timeout=timeout):
                    if type_ == "DELETED":
                        return obj
            except NotFound:
                return obj
            try:
                await self.get(name)
            except NotFound:
                return obj
            raise WaitTimeout(f"rolloutjob {name} still exists after {timeout:g}s", obj)
        return obj

    async def wait(self, name: str, condition: str = "Complete", timeout: float | None = None) -> dict[str, Any]:
        obj = await self.get(name)
        ok, never = condition_met(obj, condition)
        if ok:
            return obj
        if never:
            raise JobEnded(f"rolloutjob {name}: {never}", obj)
        async for type_, new, _ in self.watch(name, since=obj["metadata"]["resourceVersion"], timeout=timeout):
            if type_ == "DELETED":
                raise JobEnded(f"rolloutjob {name} was deleted", new)
            obj = new
            ok, never = condition_met(obj, condition)
            if ok:
                return obj
            if never:
                raise JobEnded(f"rolloutjob {name}: {never}", obj)
        raise WaitTimeout(f"timed out after {timeout:g}s waiting for {condition} on rolloutjob/{name}", obj)

    async def watch(self, name: str | None = None, since: str | None = None,
                    timeout: float | None = None) -> AsyncIterator[tuple[str, dict[str, Any], str | None]]:
        deadline = time.monotonic() + timeout if timeout is not None else None
        last, failures = since, 0
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            call = Calls.watch(name, last, left)
            try:
                async with self.http.stream(call.method, call.path, **call.kwargs()) as r:
                    if r.status_code >= 400:
                        await r.aread()
                        raise status_error(r)
                    parser = SSEParser()
                    async for line in r.aiter_lines():
                        ev = parser.feed(line)
                        if ev is None:
                            continue
                        failures = 0
                        last = ev[2] or last
                        if ev[0] != "BOOKMARK":
                            yield ev
            except (httpx.TransportError, ValueError) as e:
                failures += 1
                await self._backoff(failures, "the watch stream", e)

    # ------------------------------------------------------------ results

    async def trajectories(self, name: str, cursor: int = 0, follow: bool = False,
                           timeout: float | None = None, page: int = 1000) -> AsyncIterator[dict[str, Any]]:
        if not follow:
            while True:
                rows = await self._do(Calls.trajectory_page(name, cursor, page))
                for t in rows:
                    yield t
                if len(rows) < page:
                    return
                cursor = rows[-1]["seq"]
        deadline = time.monotonic() + timeout if timeout is not None else None
        failures = 0
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            call = Calls.follow(name, cursor, left)
            try:
                async with self.http.stream(call.method, call.path, **call.kwargs()) as r:
                    if r.status_code >= 400:
                        await r.aread()
                        raise status_error(r)
                    async for line in r.aiter_lines():
                        t = trajectory_line(line)
                        if t is not None:
                            failures = 0
                            cursor = t["seq"]
                            yield t
                return
            except (httpx.TransportError, ValueError) as e:
                failures += 1
                await self._backoff(failures, "the trajectory stream", e)

    async def groups(self, name: str) -> list[dict[str, Any]]:
        return await self._do(Calls.groups(name))

    async def iter_groups(self, name: str, cursor: int = 0, follow: bool = True,
                          timeout: float | None = None) -> AsyncIterator[Group]:
        samples = int((await self.get(name))["spec"].get("samplesPerPrompt", 1))
        asm = GroupAssembler(samples)
        async for t in self.trajectories(name, cursor=cursor, follow=follow, timeout=timeout):
            g = asm.add(t)
            if g is not None:
                yield g

    # ------------------------------------------------------------ batches

    async def request_batch(self, name: str, batch: int | None = None,
                            prompts: list[int] | None = None) -> dict[str, Any]:
        return await self._do(Calls.request_batch(name, batch, prompts))

    async def batch(self, name: str, k: int, wait: bool = True, timeout: float | None = None,
                    all_groups: bool = False) -> Batch:
        deadline = time.monotonic() + timeout if timeout is not None else None
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            slice_ = POLL_SLICE_SECONDS if left is None else min(POLL_SLICE_SECONDS, left)
            b = Batch.from_wire(await self._do(Calls.batch(name, k, wait, slice_, all_groups)))
            if not wait or b.complete or (deadline is not None and time.monotonic() >= deadline):
                return b

    async def next_batch(self, name: str, timeout: float | None = None, all_groups: bool = False) -> Batch:
        k = self._pending.get(name)
        if k is None:
            k = int((await self.request_batch(name))["batch"])
            self._pending[name] = k
        b = await self.batch(name, k, wait=True, timeout=timeout, all_groups=all_groups)
        if not b.complete:
            raise WaitTimeout(f"batch {k} of rolloutjob {name}: {b.counted}/{b.target} groups after {timeout:g}s", b)
        del self._pending[name]
        return b

    # ------------------------------------------------------------ policy and backends

    async def announce_policy(self, name: str, version: int | str, weights_path: str | Path | None = None,
                              pause: bool = True, timeout: float | None = None) -> dict[str, Any]:
        return await self._do(Calls.announce_policy(name, version, weights_path, pause, timeout))

    async def policy(self, name: str) -> dict[str, Any]:
        return await self._do(Calls.policy(name))

    async def backends(self, name: str) -> list[dict[str, Any]]:
        return await self._do(Calls.backends(name))

    async def add_backend(self, name: str, url: str) -> list[dict[str, Any]]:
        return await self._do(Calls.add_backend(name, url))

    async def remove_backend(self, name: str, url: str) -> list[dict[str, Any]]:
        return await self._do(Calls.remove_backend(name, url))


__all__ = ["AsyncRolloutClient"]
