"""Finished rollouts' results on their way to the controller: serialized once, batched, resent until acknowledged.

`pipeline.Pipeline` puts results in (`submit`); the controller's ack (or `dropped`) takes them out. Batches
are capped by count and bytes; a batch refused as too large (413) is resent one by one, and a result refused
for good becomes an `infra` failure of its attempt (a stand-in), so no item is ever left leased.
With beat-results served (`on_beats`), `heartbeat.Heartbeater` carries them on beats instead; the outbox's
own POST …/results is left for those a beat cannot carry (too large, refused on a beat) and for `flush`.
A result is on one call at most at a time (`in_flight`).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rolloutd.crds.node import HeartbeatResponse, Lease, Result, ResultAck
from rolloutd.crds.trajectory import Trajectory

from rolloutd.crds.kit.aiokit import Backoff, wait_event
from .controller_client import ControllerClient, ControllerError, result_json
from .lease import Leaser
from .options import NodeOptions


@dataclass
class Outgoing:
    body: bytes          # the Result's wire JSON, serialized once
    lease: Lease
    stub: bool = False   # a stand-in infra failure for a result the controller refused
    direct: bool = False  # by POST …/results even when results ride on beats (too large for a beat, or refused on one)


def _any(out: Outgoing) -> bool:
    return True


def _for_beats(out: Outgoing) -> bool:
    return not out.direct


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
        self.on_beats = False                # beat-results served: beats carry results (set at registration)
        self.beat_soon: Callable[[], None] = lambda: None  # set by the daemon: a result waits for a beat
        self.in_flight: set[str] = set()     # on a call (beat or results) not answered yet
        self._ready = asyncio.Event()        # something to send
        self._released = asyncio.Event()     # a call's results are no longer in flight

    def submit(self, aid: str, lease: Lease, t: Trajectory) -> None:
        body = result_json(Result(attempt_id=aid, trajectory=t))
        direct = self.on_beats and len(body) > self.opts.result_batch_bytes  # no beat may carry it
        self.pending[aid] = Outgoing(body, lease, direct=direct)
        self.stats["finished"] += 1
        if self.on_beats and not direct:
            self.beat_soon()
        else:
            self._ready.set()

    def drop(self, aid: str) -> None:
        """Forget an undelivered result (cancelled, or the controller no longer leases it)."""
        if self.pending.pop(aid, None) is not None:
            self.log.info("result %s not sent: the controller cancelled or forgot the attempt", aid)
            self._changed()

    def _loop_sends(self, out: Outgoing) -> bool:
        return out.direct or not self.on_beats

    async def loop(self) -> None:
        backoff = Backoff(0.1, self.opts.retry_max)
        while True:
            await self._ready.wait()
            await asyncio.sleep(self.coalesce)
            self._ready.clear()
            if not await self._send(self._loop_sends):
                await asyncio.sleep(backoff.next())
                self._ready.set()
            else:
                backoff.reset()
                if self.next_batch(self._loop_sends):
                    self._ready.set()

    async def flush(self) -> None:
        """At exit: keep sending (by POST …/results, whatever `on_beats`) for `flush_seconds` at most."""
        deadline = time.monotonic() + self.opts.flush_seconds
        backoff = Backoff(0.1, min(2.0, self.opts.retry_max))
        while self.pending and time.monotonic() < deadline:
            self._released.clear()
            if not self.next_batch():  # all on a call in flight: its answer settles them
                await wait_event(self._released, deadline - time.monotonic())
                continue
            if not await self._send():
                await asyncio.sleep(min(backoff.next(), max(deadline - time.monotonic(), 0)))
        if self.pending:
            self.log.error("could not deliver %d result(s): %s", len(self.pending), sorted(self.pending))

    def next_batch(self, wanted: Callable[[Outgoing], bool] = _any) -> list[tuple[str, bytes]]:
        """The next results to send (those `wanted`, not in flight), capped by count and bytes (the first one
        goes even if over the byte cap)."""
        batch: list[tuple[str, bytes]] = []
        size = 0
        for aid, out in self.pending.items():
            if aid in self.in_flight or not wanted(out):
                continue
            body = out.body
            if batch and (len(batch) >= self.opts.result_batch or size + len(body) > self.opts.result_batch_bytes):
                break
            batch.append((aid, body))
            size += len(body) + 1
        return batch

    # ------------------------------------------------------------------ on beats (beat-results)
    def take_for_beat(self) -> list[tuple[str, bytes]]:
        """Results for the next beat, in flight until `release`; none unless beat-results is served."""
        if not self.on_beats:
            return []
        batch = self.next_batch(_for_beats)
        self.in_flight.update(aid for aid, _ in batch)
        return batch

    def release(self, aids: list[str]) -> None:
        """The call that carried `aids` is over (answered or not): what is still pending may go again."""
        if not aids:
            return
        self.in_flight.difference_update(aids)
        self._released.set()
        if self.next_batch(self._loop_sends):
            self._ready.set()

    def beat_answered(self, aids: list[str], resp: HeartbeatResponse) -> None:
        self.stats["results_on_beats"] += len(aids)
        self._acked(aids, ResultAck(accepted=resp.accepted or [], dropped=resp.dropped or {}))

    def beat_refused(self, aids: list[str]) -> None:
        """The controller refused (413, invalid) a beat that carried `aids`: they go by POST …/results, where a
        batch too large is split and a result refused alone becomes a stand-in."""
        for aid in aids:
            out = self.pending.get(aid)
            if out is not None:
                out.direct = True
        self.stats["results_off_beats"] += len(aids)
        self._ready.set()

    # ------------------------------------------------------------------ by POST …/results
    async def _send(self, wanted: Callable[[Outgoing], bool] = _any) -> bool:
        """Send one batch; False when the controller could not be reached (the batch stays)."""
        assert self.node_id is not None
        batch = self.next_batch(wanted)
        if not batch:
            return True
        aids = [aid for aid, _ in batch]
        self.in_flight.update(aids)
        try:
            return await self._post(batch)
        finally:
            self.release(aids)

    async def _post(self, batch: list[tuple[str, bytes]]) -> bool:
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
            if e.status in (400, 413, 422) and len(batch) > 1:
                # too large together, or one of them refused as invalid: one by one, so that only a result the
                # controller cannot take alone becomes a stand-in, not the others of its batch
                self.log.warning("results: a batch of %d refused (%s); sending them singly", len(batch), e)
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
        self.pending[aid] = Outgoing(result_json(Result(attempt_id=aid, trajectory=stub)), out.lease, stub=True,
                                     direct=True)
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
