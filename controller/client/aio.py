"""`AsyncRolloutClient`: the asyncio twin of `sync.RolloutClient` — the same methods, as
coroutines (and async iterators for `trajectories`, `iter_groups`, `watch`), for trainers whose
loop is async. Requests come from `calls.Calls` and the loops' state from `core`, both shared with
the sync client.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, AsyncIterator

import httpx

from rolloutd.crds.names import job_key

from .batch import Batch, Group
from .calls import Call, Calls
from .connection import Connection, client_options, resolve
from .core import (BatchPoll, GroupAssembler, JobWait, Stream, TrajectoryStream, WatchStream, job_over, still_exists,
                   unfilled)
from .errors import ClientError, NotFound, status_error, unreachable
from .retry import RETRY_FOR_SECONDS, RETRY_STATUS, Retry


class AsyncRolloutClient:
    """See `RolloutClient`; use as `async with AsyncRolloutClient() as rc: ...`."""

    def __init__(self, server: str | None = None, *, token: str | None = None, token_file: str | Path | None = None,
                 namespace: str | None = None, ca_file: str | Path | None = None,
                 connection: Connection | None = None, timeout: float = 30.0,
                 retry_for: float | None = RETRY_FOR_SECONDS, transport: httpx.AsyncBaseTransport | None = None):
        self.conn = connection or resolve(server, token_file, token, namespace, ca_file)
        self.namespace = namespace or self.conn.namespace  # of every job named by its name alone
        self.http = httpx.AsyncClient(**{**client_options(self.conn, timeout, asynchronous=True), **({'transport': transport} if transport else {})})
        self.retry_for = retry_for
        self.retry_backoff = 0.2
        self._pending: dict[str, int] = {}

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> "AsyncRolloutClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    # ------------------------------------------------------------ plumbing

    def _key(self, name: str) -> str:
        return job_key(self.namespace, name)

    def _retry(self, deadline: float | None = None) -> Retry:
        return Retry(self.conn.server, self.retry_for, deadline, self.retry_backoff)

    async def _do(self, call: Call, retry: Retry | None = None) -> Any:
        retry = retry or self._retry()
        while True:
            try:
                r = await self.http.request(call.method, call.path, **call.kwargs())
            except httpx.TransportError as e:
                await asyncio.sleep(retry.after(e, call.idempotent))
                continue
            if r.status_code in RETRY_STATUS:
                await asyncio.sleep(retry.after(status_error(r), call.idempotent, r.headers.get("retry-after")))
                continue
            if r.status_code >= 400:
                raise status_error(r)
            retry.ok()
            return call.result(r)

    async def _stream(self, stream: Stream):
        """Run a core stream: open, feed lines, resume after a drop or a restart (back-off from the stream)."""
        while (call := stream.next_call()) is not None:
            try:
                async with self.http.stream(call.method, call.path, **call.kwargs()) as r:
                    if r.status_code >= 400:
                        await r.aread()
                        raise status_error(r)
                    stream.opened()
                    async for line in r.aiter_lines():
                        if (item := stream.feed(line)) is not None:
                            yield item
                if stream.final or (stream.final is None and job_over(await self._job_or_none(stream.name))):
                    return
            except (httpx.TransportError, ValueError) as e:
                await asyncio.sleep(stream.failed(e))
            except NotFound:
                if stream.final is None and stream.resumed:  # deleted while the stream was down: it is complete
                    return
                raise
            except ClientError as e:
                if e.code not in RETRY_STATUS:
                    raise
                await asyncio.sleep(stream.failed(e))

    async def _job_or_none(self, key: str) -> dict[str, Any] | None:
        try:
            return await self._do(Calls.get(key))
        except NotFound:
            return None

    # ------------------------------------------------------------ jobs

    async def apply(self, job: dict[str, Any] | str | Path) -> dict[str, Any]:
        return (await self._do(Calls.apply(job, self.namespace)))[0]

    async def apply_with_outcome(self, job: dict[str, Any] | str | Path) -> tuple[dict[str, Any], str]:
        return await self._do(Calls.apply(job, self.namespace))

    async def get(self, name: str) -> dict[str, Any]:
        return await self._do(Calls.get(self._key(name)))

    async def list(self, selector: str | None = None, all_namespaces: bool = False) -> dict[str, Any]:
        return await self._do(Calls.list(selector, None if all_namespaces else self.namespace))

    async def events(self, name: str) -> list[dict[str, Any]]:
        return await self._do(Calls.events(self._key(name)))

    async def delete(self, name: str, wait: bool = False, timeout: float | None = None) -> dict[str, Any]:
        obj = await self._do(Calls.delete(self._key(name)))
        if wait:
            try:
                async for type_, _obj, _ in self.watch(name, since=obj["metadata"]["resourceVersion"],
                                                       timeout=timeout):
                    if type_ == "DELETED":
                        return obj
                await self.get(name)
            except NotFound:
                return obj
            raise still_exists(name, obj, timeout)
        return obj

    async def wait(self, name: str, condition: str = "Complete", timeout: float | None = None) -> dict[str, Any]:
        check = JobWait(name, condition, timeout)
        obj = await self.get(name)
        if check.met(obj):
            return obj
        async for type_, obj, _ in self.watch(name, since=obj["metadata"]["resourceVersion"], timeout=timeout):
            if check.met(obj, type_):
                return obj
        raise check.timed_out(obj)

    def watch(self, name: str | None = None, since: str | None = None,
              timeout: float | None = None) -> AsyncIterator[tuple[str, dict[str, Any], str | None]]:
        return self._stream(WatchStream(name and self._key(name), self.namespace, since, timeout, self.retry_backoff,
                                        self.conn.server, self.retry_for))

    # ------------------------------------------------------------ results

    async def trajectories(self, name: str, cursor: int = 0, follow: bool = False,
                           timeout: float | None = None, page: int = 1000) -> AsyncIterator[dict[str, Any]]:
        if follow:
            async for t in self._stream(TrajectoryStream(self._key(name), cursor, timeout, self.retry_backoff,
                                                         self.conn.server, self.retry_for)):
                yield t
            return
        while True:
            rows = await self._do(Calls.trajectory_page(self._key(name), cursor, page))
            for t in rows:
                yield t
            if len(rows) < page:
                return
            cursor = rows[-1]["seq"]

    async def logs(self, name: str, node: int | None = None, tail: int = 200,
                   follow: bool = False) -> AsyncIterator[str]:
        call = Calls.logs(self._key(name), node, tail, follow)
        try:
            async with self.http.stream(call.method, call.path, **call.kwargs()) as r:
                if r.status_code >= 400:
                    await r.aread()
                    raise status_error(r)
                async for line in r.aiter_lines():
                    yield line
        except httpx.TransportError as e:
            raise unreachable(self.conn.server, e) from None

    async def purge_results(self, name: str) -> dict[str, Any]:
        """Remove a deleted job's results now (they are kept for the controller's retention period otherwise)."""
        return await self._do(Calls.purge_results(self._key(name)))

    async def inflight(self, name: str, stalled_after: float | None = None,
                       limit: int | None = None) -> dict[str, Any]:
        return await self._do(Calls.inflight(self._key(name), stalled_after, limit))

    async def stats(self, name: str) -> dict[str, Any]:
        return await self._do(Calls.stats(self._key(name)))

    async def groups(self, name: str) -> list[dict[str, Any]]:
        return await self._do(Calls.groups(self._key(name)))

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
        return await self._do(Calls.request_batch(self._key(name), batch, prompts))

    async def batch(self, name: str, k: int, wait: bool = True, timeout: float | None = None,
                    all_groups: bool = False) -> Batch:
        poll = BatchPoll(self._key(name), k, wait, timeout, all_groups)
        retry = self._retry(poll.deadline)
        while True:
            b = Batch.from_wire(await self._do(poll.call(), retry))
            if poll.done(b):
                return b

    async def next_batch(self, name: str, timeout: float | None = None, all_groups: bool = False) -> Batch:
        k = self._pending.get(name)
        if k is None:
            k = int((await self.request_batch(name))["batch"])
            self._pending[name] = k
        b = await self.batch(name, k, wait=True, timeout=timeout, all_groups=all_groups)
        if not b.complete:
            raise unfilled(name, k, b, timeout)
        del self._pending[name]
        return b

    # ------------------------------------------------------------ policy and backends

    async def announce_policy(self, name: str, version: int | str, weights_path: str | Path | None = None,
                              pause: bool = True, timeout: float | None = None) -> dict[str, Any]:
        return await self._do(Calls.announce_policy(self._key(name), version, weights_path, pause, timeout))

    async def policy(self, name: str) -> dict[str, Any]:
        return await self._do(Calls.policy(self._key(name)))

    async def backends(self, name: str) -> list[dict[str, Any]]:
        return await self._do(Calls.backends(self._key(name)))

    async def add_backend(self, name: str, url: str) -> list[dict[str, Any]]:
        return await self._do(Calls.add_backend(self._key(name), url))

    async def remove_backend(self, name: str, url: str) -> list[dict[str, Any]]:
        return await self._do(Calls.remove_backend(self._key(name), url))


__all__ = ["AsyncRolloutClient"]
