"""`RolloutClient`: the synchronous trainer client (and the engine under `rolloutctl`).

Every single-request method sends a `calls.Calls` request (shared with the async client,
`aio.AsyncRolloutClient`, which has the same methods as coroutines / async iterators); the loops
(streams with retry, long-polls, waits) are `core`'s state, driven here by a few lines of I/O.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import httpx

from rolloutd.crds.names import job_key

from .batch import Batch, Group
from .calls import Call, Calls
from .connection import Connection, client_options, resolve
from .core import (BatchPoll, GroupAssembler, JobWait, Stream, TrajectoryStream, WatchStream, job_over, still_exists,
                   unfilled)
from .errors import ClientError, NotFound, RolloutdError, status_error, unreachable
from .retry import RETRY_FOR_SECONDS, RETRY_STATUS, Retry


class RolloutClient:
    """Talks to one rolloutd controller.

        with RolloutClient() as rc:                 # server/token resolved like rolloutctl
            rc.apply("job.yaml")
            batch = rc.next_batch("my-job")
            arrays = batch.to_arrays(pad_id=tok.pad_token_id)

    Errors are `ClientError` subclasses carrying the server's Status (`reason`, `code`,
    `causes`); `ConnectionFailed` when the controller cannot be reached.
    A controller restart is ridden through: every call and stream retries an unreachable or stopping
    controller (back-off with jitter) for up to `retry_for` seconds in a row (None: no limit; 0: never),
    and never past the call's own `timeout`; streams and long polls resume where they were.
    `transport=` (an `httpx.BaseTransport`) is the test seam.
    """

    def __init__(self, server: str | None = None, *, token: str | None = None, token_file: str | Path | None = None,
                 namespace: str | None = None, ca_file: str | Path | None = None,
                 connection: Connection | None = None, timeout: float = 30.0,
                 retry_for: float | None = RETRY_FOR_SECONDS, transport: httpx.BaseTransport | None = None):
        self.conn = connection or resolve(server, token_file, token, namespace, ca_file)
        self.namespace = namespace or self.conn.namespace  # of every job named by its name alone
        self.http = httpx.Client(**{**client_options(self.conn, timeout), **({'transport': transport} if transport else {})})
        self.retry_for = retry_for
        self.retry_backoff = 0.2  # seconds, the first delay of a retry (doubled per failure in a row, to 5 s)
        self._pending: dict[str, int] = {}  # job → batch requested by next_batch but not yet returned

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ plumbing

    def _key(self, name: str) -> str:
        return job_key(self.namespace, name)

    def _retry(self, deadline: float | None = None) -> Retry:
        return Retry(self.conn.server, self.retry_for, deadline, self.retry_backoff)

    def _do(self, call: Call, retry: Retry | None = None) -> Any:
        """Send `call`, retried through a restart (`retry.Retry`); its answer, or the typed error."""
        retry = retry or self._retry()
        while True:
            try:
                r = self.http.request(call.method, call.path, **call.kwargs())
            except httpx.TransportError as e:
                time.sleep(retry.after(e, call.idempotent))
                continue
            if r.status_code in RETRY_STATUS:
                time.sleep(retry.after(status_error(r), call.idempotent, r.headers.get("retry-after")))
                continue
            if r.status_code >= 400:
                raise status_error(r)
            retry.ok()
            return call.result(r)

    def _stream(self, stream: Stream):
        """Run a core stream: open, feed lines, resume after a drop or a restart (back-off from the stream)."""
        while (call := stream.next_call()) is not None:
            try:
                with self.http.stream(call.method, call.path, **call.kwargs()) as r:
                    if r.status_code >= 400:
                        r.read()
                        raise status_error(r)
                    stream.opened()
                    for line in r.iter_lines():
                        if (item := stream.feed(line)) is not None:
                            yield item
                if stream.final or (stream.final is None and job_over(self._job_or_none(stream.name))):
                    return
            except (httpx.TransportError, ValueError) as e:
                time.sleep(stream.failed(e))
            except NotFound:
                if stream.final is None and stream.resumed:  # deleted while the stream was down: it is complete
                    return
                raise
            except ClientError as e:
                if e.code not in RETRY_STATUS:
                    raise
                time.sleep(stream.failed(e))

    def _job_or_none(self, key: str) -> dict[str, Any] | None:
        try:
            return self._do(Calls.get(key))
        except NotFound:
            return None

    # ------------------------------------------------------------ jobs

    def apply(self, job: dict[str, Any] | str | Path) -> dict[str, Any]:
        """Create or update a job (server-side apply) from a dict, a YAML/JSON file path or text;
        returns the stored object."""
        return self._do(Calls.apply(job, self.namespace))[0]

    def apply_with_outcome(self, job: dict[str, Any] | str | Path) -> tuple[dict[str, Any], str]:
        """`apply`, plus the outcome: `created`, `configured` or `unchanged`."""
        return self._do(Calls.apply(job, self.namespace))

    def get(self, name: str) -> dict[str, Any]:
        return self._do(Calls.get(self._key(name)))

    def list(self, selector: str | None = None, all_namespaces: bool = False) -> dict[str, Any]:
        return self._do(Calls.list(selector, None if all_namespaces else self.namespace))

    def events(self, name: str) -> list[dict[str, Any]]:
        return self._do(Calls.events(self._key(name)))

    def delete(self, name: str, wait: bool = False, timeout: float | None = None) -> dict[str, Any]:
        """Delete a job (its live rollouts are cancelled on the daemons). With `wait`, return
        only once it is gone (`WaitTimeout` after `timeout` seconds)."""
        obj = self._do(Calls.delete(self._key(name)))
        if wait:
            try:
                for type_, _obj, _ in self.watch(name, since=obj["metadata"]["resourceVersion"], timeout=timeout):
                    if type_ == "DELETED":
                        return obj
                self.get(name)
            except NotFound:
                return obj
            raise still_exists(name, obj, timeout)
        return obj

    def wait(self, name: str, condition: str = "Complete", timeout: float | None = None) -> dict[str, Any]:
        """Block until `condition` holds (a condition type such as `Complete`, or `phase=Running`);
        returns the job. `JobEnded` if it ends (or is deleted) without it, `WaitTimeout` after `timeout`."""
        check = JobWait(name, condition, timeout)
        obj = self.get(name)
        if check.met(obj):
            return obj
        for type_, obj, _ in self.watch(name, since=obj["metadata"]["resourceVersion"], timeout=timeout):
            if check.met(obj, type_):
                return obj
        raise check.timed_out(obj)

    def watch(self, name: str | None = None, since: str | None = None,
              timeout: float | None = None) -> Iterator[tuple[str, dict[str, Any], str | None]]:
        """(type, object, resourceVersion) per change; reconnects from the last version seen if the
        stream drops. Without `since`, starts with a synthetic ADDED per existing job."""
        return self._stream(WatchStream(name and self._key(name), self.namespace, since, timeout, self.retry_backoff,
                                        self.conn.server, self.retry_for))

    # ------------------------------------------------------------ results

    def trajectories(self, name: str, cursor: int = 0, follow: bool = False,
                     timeout: float | None = None, page: int = 1000) -> Iterator[dict[str, Any]]:
        """Every trajectory after `cursor` (each carries its `seq`, the cursor to resume from).
        Without `follow`: what exists now, fetched page by page. With `follow`: as they arrive,
        until the job ends (or `timeout`). A dropped stream is resumed after the last `seq`
        received, so nothing is lost or repeated."""
        if follow:
            yield from self._stream(TrajectoryStream(self._key(name), cursor, timeout, self.retry_backoff,
                                                     self.conn.server, self.retry_for))
            return
        while True:
            rows = self._do(Calls.trajectory_page(self._key(name), cursor, page))
            yield from rows
            if len(rows) < page:
                return
            cursor = rows[-1]["seq"]

    def logs(self, name: str, node: int | None = None, tail: int = 200, follow: bool = False) -> Iterator[str]:
        """The job's node daemons' log lines (`node`: one daemon's; several are prefixed `[nodeK]`), each source's
        last `tail`; with `follow`, new ones until the job ends."""
        call = Calls.logs(self._key(name), node, tail, follow)
        try:
            with self.http.stream(call.method, call.path, **call.kwargs()) as r:
                if r.status_code >= 400:
                    r.read()
                    raise status_error(r)
                yield from r.iter_lines()
        except httpx.TransportError as e:
            raise unreachable(self.conn.server, e) from None

    def purge_results(self, name: str) -> dict[str, Any]:
        """Remove a deleted job's results now (they are kept for the controller's retention period otherwise)."""
        return self._do(Calls.purge_results(self._key(name)))

    def inflight(self, name: str, stalled_after: float | None = None, limit: int | None = None) -> dict[str, Any]:
        """The job's rollouts in flight: `{total, stalled, stages, stalledAfterSeconds, truncated, items}`, each
        item a rollout's stage, time in stage, last heartbeat, node, backend, attempt and `stalled` flag."""
        return self._do(Calls.inflight(self._key(name), stalled_after, limit))

    def stats(self, name: str) -> dict[str, Any]:
        """`{delivered, byKind, infraRate, rewardMean, stages: [{stage, n, p50, p95}]}` (seconds; queue, init, run,
        eval of the rollouts that ran to the end), as `rolloutctl describe` and the web UI show them."""
        return self._do(Calls.stats(self._key(name)))

    def groups(self, name: str) -> list[dict[str, Any]]:
        """Every trajectory so far, grouped per prompt: `[{prompt, samples, rewards, complete}]`."""
        return self._do(Calls.groups(self._key(name)))

    def iter_groups(self, name: str, cursor: int = 0, follow: bool = True,
                    timeout: float | None = None) -> Iterator[Group]:
        """Whole groups as their last sample arrives (built from the trajectory stream)."""
        samples = int(self.get(name)["spec"].get("samplesPerPrompt", 1))
        asm = GroupAssembler(samples)
        for t in self.trajectories(name, cursor=cursor, follow=follow, timeout=timeout):
            g = asm.add(t)
            if g is not None:
                yield g

    # ------------------------------------------------------------ batches

    def request_batch(self, name: str, batch: int | None = None, prompts: list[int] | None = None) -> dict[str, Any]:
        """Ask for the next batch (or batch `batch`); idempotent for the current batch.
        `prompts` (plain batches only): the dataset indices to run, one group each; the batch is
        then complete when every one of those groups settled, none replaced.
        Returns `{batch, state, target, counted, prompts, …}` without the groups."""
        return self._do(Calls.request_batch(self._key(name), batch, prompts))

    def batch(self, name: str, k: int, wait: bool = True, timeout: float | None = None,
              all_groups: bool = False) -> Batch:
        """Batch `k`. With `wait`, blocks until it is complete or `timeout` seconds passed, and
        returns its state then (check `Batch.complete`)."""
        poll = BatchPoll(self._key(name), k, wait, timeout, all_groups)
        retry = self._retry(poll.deadline)
        while True:
            b = Batch.from_wire(self._do(poll.call(), retry))
            if poll.done(b):
                return b

    def next_batch(self, name: str, timeout: float | None = None, all_groups: bool = False) -> Batch:
        """Request the next batch and wait until it is full; `WaitTimeout` (with `.last`, the
        partial batch) after `timeout`. After a timeout, the next call waits for the same batch
        again rather than requesting another one."""
        k = self._pending.get(name)
        if k is None:
            k = int(self.request_batch(name)["batch"])
            self._pending[name] = k
        b = self.batch(name, k, wait=True, timeout=timeout, all_groups=all_groups)
        if not b.complete:
            raise unfilled(name, k, b, timeout)
        del self._pending[name]
        return b

    # ------------------------------------------------------------ policy and backends

    def announce_policy(self, name: str, version: int | str, weights_path: str | Path | None = None,
                        pause: bool = True, timeout: float | None = None) -> dict[str, Any]:
        """Tag new rollouts with `version`; with `pause`, hold new LLM calls, drain in-flight ones,
        reload `weights_path` on every backend, reset prefix caches, resume. Blocks until applied;
        returns `{version, pausedSeconds, backends: [{url, reloaded, error}]}`."""
        return self._do(Calls.announce_policy(self._key(name), version, weights_path, pause, timeout))

    def policy(self, name: str) -> dict[str, Any]:
        """`{version, history}`."""
        return self._do(Calls.policy(self._key(name)))

    def backends(self, name: str) -> list[dict[str, Any]]:
        """`[{url, healthy, reason, inflight, pinnedToJob}]`."""
        return self._do(Calls.backends(self._key(name)))

    def add_backend(self, name: str, url: str) -> list[dict[str, Any]]:
        return self._do(Calls.add_backend(self._key(name), url))

    def remove_backend(self, name: str, url: str) -> list[dict[str, Any]]:
        return self._do(Calls.remove_backend(self._key(name), url))


__all__ = ["RolloutClient", "ClientError", "RolloutdError"]
