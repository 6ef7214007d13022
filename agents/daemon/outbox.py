"""Finished rollouts' results on their way to the controller: serialized once, batched, resent until acknowledged.

`pipeline.Pipeline` puts results in (`submit`); the controller's ack (or `dropped`) takes them out. Batches
are capped by count and bytes; a batch refused as too large (413) is resent one by one, and a result refused
for good becomes an `infra` failure of its attempt (a stand-in), so no item is ever left leased.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rolloutd.crds.node import Lease, Result
from rolloutd.crds.trajectory import Trajectory

from ..aiokit import Backoff
from .controller_client import ControllerClient, ControllerError, result_json
from .lease import Leaser
from .options import NodeOptions


@dataclass
class Outgoing:
    body: bytes          # the Result's wire JSON, serialized once
    lease: Lease
    stub: bool = False   # a stand-in infra failure for a result the controller refused


class Outbox:
    """Results not acknowledged yet (`pending`, by attemptId); `loop` delivers them, `flush` at exit.

    `stand_in(lease, reason)` makes the infra failure sent instead of a result refused for good."""

    def __init__(self, client: ControllerClient, opts: NodeOptions, log: logging.LoggerAdapter,
                 stats: collections.Counter[str], changed: Callable[[], None],
                 stand_in: Callable[[Lease, str], Trajectory]) -> None:
        self.client, self.opts, self.log, self.stats = client, opts, log, stats
        self._changed, self._stand_in = changed, stand_in
        self.node_id: str | None = None     # set once registered
        self.pending: dict[str, Outgoing] = {}
        self.coalesce = opts.result_coalesce  # grows with the cluster (`crds.node.result_coalesce`) at registration
        self.leaser: Leaser | None = None    # set by the daemon: results calls carry its lease asks
        self._ready = asyncio.Event()        # something to send

    def submit(self, aid: str, lease: Lease, t: Trajectory) -> None:
        self.pending[aid] = Outgoing(result_json(Result(attempt_id=aid, trajectory=t)), lease)
        self.stats["finished"] += 1
        self._ready.set()

    def drop(self, aid: str) -> None:
        """Forget an undelivered result (cancelled, or the controller no longer leases it)."""
        if self.pending.pop(aid, None) is not None:
            self.log.info("result %s not sent: the controller cancelled or forgot the attempt", aid)
            self._changed()

    async def loop(self) -> None:
        backoff = Backoff(0.1, self.opts.retry_max)
        while True:
            await self._ready.wait()
            await asyncio.sleep(self.coalesce)
            self._ready.clear()
            if not await self._send():
                await asyncio.sleep(backoff.next())
                self._ready.set()
            else:
                backoff.reset()
                if self.pending:
                    self._ready.set()

    async def flush(self) -> None:
        """At exit: keep sending for `flush_seconds` at most."""
        deadline = time.monotonic() + self.opts.flush_seconds
        backoff = Backoff(0.1, min(2.0, self.opts.retry_max))
        while self.pending and time.monotonic() < deadline:
            if not await self._send():
                await asyncio.sleep(min(backoff.next(), max(deadline - time.monotonic(), 0)))
        if self.pending:
            self.log.error("could not deliver %d result(s): %s", len(self.pending), sorted(self.pending))

    def next_batch(self) -> list[tuple[str, bytes]]:
        batch: list[tuple[str, bytes]] = []
        size = 0
        for aid, out in self.pending.items():
            body = out.body
            if batch and (len(batch) >= self.opts.result_batch or size + len(body) > self.opts.result_batch_bytes):
                break
            batch.append((aid, body))
            size += len(body) + 1
        return batch

    async def _send(self) -> bool:
        """Send one batch; False when the controller could not be reached (the batch stays)."""
        assert self.node_id is not None
        batch = self.next_batch()
        if not batch:
            return True
        ask = self.leaser.ask() if self.leaser is not None else None
        try:
            ack = await self.client.results(self.node_id, [body for _, body in batch], lease=ask)
        except ControllerError as e:
            if self.leaser is not None:
                self.leaser.failed(ask)
            self.stats["result_failures"] += 1
            if e.retryable:
                self.log.warning("results: %s; %d result(s) kept for a retry", e, len(self.pending))
                return False
            if e.status == 413 and len(batch) > 1:
                # too large together: send them one by one (each alone may still fit)
                self.log.warning("results: %d result(s) too large as one batch; sending them singly", len(batch))
                return await self._send_singly(batch)
            for aid, body in batch:
                self._refused(aid, body, e)
            return True
        self._acked([aid for aid, _ in batch], ack)
        if self.leaser is not None:
            await self.leaser.answered(ask, ack.lease, "results")
        return True

    async def _send_singly(self, batch: list[tuple[str, bytes]]) -> bool:
        for aid, body in batch:
            try:
                ack = await self.client.results(self.node_id, [body])
            except ControllerError as e:
                self.stats["result_failures"] += 1
                if e.retryable:
                    return False
                self._refused(aid, body, e)
                continue
            self._acked([aid], ack)
        return True

    def _refused(self, aid: str, body: bytes, error: ControllerError) -> None:
        """The controller refuses a result for good (too large, invalid): report the attempt as an
        infrastructure failure instead, so the item is retried or given up, never stuck leased.
        A refused stand-in is dropped."""
        self.stats["results_refused"] += 1
        out = self.pending.get(aid)
        if out is None:
            return
        if out.stub:
            self.log.error("result %s refused again (%s); dropping it", aid, error)
            self.pending.pop(aid, None)
            self._changed()
            return
        self.log.error("result %s refused (%s, %d bytes); reporting an infrastructure failure instead",
                       aid, error, len(body))
        stub = self._stand_in(out.lease, f"the controller refused the result ({len(body)} bytes): {error}")
        self.pending[aid] = Outgoing(result_json(Result(attempt_id=aid, trajectory=stub)), out.lease, stub=True)
        self._ready.set()

    def _acked(self, aids: list[str], ack: Any) -> None:
        self.stats["result_batches"] += 1
        for aid in aids:
            # a result cancelled after it was sent is gone from the outbox already
            self.pending.pop(aid, None)
        if ack is not None:
            self.stats["results_accepted"] += len(ack.accepted)
            for aid, why in ack.dropped.items():
                self.stats["results_dropped"] += 1
                self.log.info("result %s dropped by the controller: %s", aid, why)
        self._changed()
