"""Leasing: pull work from the controller while the pools have room, hand back what the node will not start.

`daemon.NodeDaemon` runs `Leaser.loop` while it is leasing; every lease becomes a rollout (`rollouts.Rollouts.start`)
that `pipeline.Pipeline` runs.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from rolloutd.crds.node import Lease, LeaseRequest, ReturnRequest

from ..aiokit import Backoff, wait_event
from .controller_client import ControllerClient, ControllerError
from .options import NodeOptions

UNSTARTED = "node shutting down: not started"


class Leaser:
    """Leases for one registered node. The daemon decides whether to go on (`leasing()`), how much fits
    (`room()`) and what a lease becomes (`start(lease)`); the rest are callbacks on the controller's word."""

    def __init__(self, client: ControllerClient, opts: NodeOptions, log: logging.LoggerAdapter,
                 stats: collections.Counter[str], *, leasing: Callable[[], bool], stopping: Callable[[], bool],
                 room: Callable[[], int], start: Callable[[Lease], None], on_gone: Callable[[str], None],
                 on_done: Callable[[], None], on_drain: Callable[[str], None], stop_event: asyncio.Event) -> None:
        self.client, self.opts, self.log, self.stats = client, opts, log, stats
        self._leasing, self._stopping, self._room_left, self._start = leasing, stopping, room, start
        self._on_gone, self._on_done, self._on_drain = on_gone, on_done, on_drain
        self._stop_event = stop_event     # SIGTERM: a back-off sleep ends at once
        self.node_id: str | None = None   # set once registered
        self.room = asyncio.Event()       # a rollout moved on or ended: re-check the room

    async def loop(self) -> None:
        assert self.node_id is not None
        backoff = Backoff(0.2, self.opts.retry_max)
        while self._leasing():
            room = self._room_left()
            if room <= 0:
                self.room.clear()
                if self._room_left() <= 0:
                    await self.room.wait()
                continue
            try:
                resp = await self.client.lease(self.node_id, LeaseRequest(max_items=room, wait=self.opts.lease_wait))
                self.stats["lease_calls"] += 1
            except ControllerError as e:
                self.stats["lease_failures"] += 1
                if e.gone:
                    self._on_gone(f"lease: {e}")
                    return
                self.log.warning("lease: %s; retrying", e)
                await wait_event(self._stop_event, backoff.next())
                continue
            backoff.reset()
            if resp.leases:
                if self._stopping():  # SIGTERM arrived during the long-poll: never start these
                    await self.give_back([lease.attempt_id for lease in resp.leases], UNSTARTED)
                else:
                    for lease in resp.leases:
                        self._start(lease)
            if resp.done:
                self.log.info("the controller has no more work for this node")
                self._on_done()
            if resp.drain:
                self._on_drain("the controller asked this node to drain (lease)")

    async def lease_one(self) -> list[Lease]:
        """One lease outside the loop (to report a configuration error on); none when the call fails."""
        try:
            resp = await self.client.lease(self.node_id, LeaseRequest(max_items=1, wait=self.opts.lease_wait))
        except ControllerError as e:
            self.log.warning("could not report the configuration error: %s", e)
            return []
        return list(resp.leases)

    async def give_back(self, attempt_ids: list[str], reason: str) -> None:
        """Hand leases back unstarted (retrying for 10 s at most; after that they expire on their own)."""
        if not attempt_ids or self.node_id is None:
            return
        backoff = Backoff(0.1, 1.0)
        deadline = time.monotonic() + 10.0
        while True:
            try:
                await self.client.give_back(self.node_id, ReturnRequest(attempt_ids=attempt_ids, reason=reason))
                self.stats["returned"] += len(attempt_ids)
                self.log.info("handed back %d lease(s): %s", len(attempt_ids), reason)
                return
            except ControllerError as e:
                if not e.retryable or time.monotonic() > deadline:
                    self.log.warning("return of %s failed (%s); the leases will expire", attempt_ids, e)
                    return
                await asyncio.sleep(backoff.next())
