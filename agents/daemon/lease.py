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

from rolloutd.crds.node import Lease, LeaseRequest, LeaseResponse, ReturnRequest

from rolloutd.crds.kit.aiokit import Backoff, wait_event
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
        # Leases ride on beat and results replies when the controller answers `?lease=N` (None: not known
        # yet, False: an older controller). `asking`: slots asked for by calls in flight; `starved`: the
        # last answer brought fewer than asked (queue empty): the loop long-polls until work comes.
        self.piggyback: bool | None = None
        self.active = False               # the lease loop runs: others' calls may ask for it
        self.asking = 0
        self.starved = False
        self.want_beat: Callable[[], None] = lambda: None  # a beat soon, to carry the ask

    def free(self) -> int:
        return self._room_left() - self.asking

    async def loop(self) -> None:
        assert self.node_id is not None
        self.active = True
        try:
            await self._loop()
        finally:
            self.active = False

    async def _loop(self) -> None:
        backoff = Backoff(0.2, self.opts.retry_max)
        while self._leasing():
            room = self.free()
            if room <= 0 or (self.piggyback and not self.starved):
                if room > 0:
                    self.want_beat()  # the next beat (or results call) asks for the room
                self.room.clear()
                if self.free() <= 0 or (self.piggyback and not self.starved):
                    await self.room.wait()
                continue
            self.asking += room
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
            finally:
                self.asking -= room
            backoff.reset()
            self.starved = len(resp.leases) < room
            await self.take(resp, "lease")

    async def take(self, resp: LeaseResponse, how: str) -> None:
        """Start what a lease answer brought (or hand it back when stopping); act on done and drain."""
        if resp.leases:
            if self._stopping():  # SIGTERM arrived during the call: never start these
                await self.give_back([lease.attempt_id for lease in resp.leases], UNSTARTED)
            else:
                for lease in resp.leases:
                    self._start(lease)
        if resp.done:
            self.log.info("the controller has no more work for this node")
            self._on_done()
        if resp.drain:
            self._on_drain(f"the controller asked this node to drain ({how})")

    def ask(self) -> int | None:
        """Leases for a beat or results call to ask for (`?lease=N`): the free room; 0 while the controller's
        support is not known yet (its answer tells); None: ask nothing."""
        if not self.active or not self._leasing() or self.piggyback is False:
            return None
        n = self.free()
        if n <= 0:
            return 0 if self.piggyback is None else None
        self.asking += n
        return n

    async def answered(self, asked: int | None, resp: LeaseResponse | None, how: str) -> None:
        """The reply to a call that asked for `asked` leases (`resp`: its `lease` field; None: the call failed
        when `failed`)."""
        if asked is None:
            return
        self.asking -= asked
        if resp is None:  # a controller that ignores the parameter: lease by our own calls
            self.piggyback = False
        else:
            self.piggyback = True
            self.stats["leases_on_" + how] += len(resp.leases)
            self.starved = len(resp.leases) < asked
            await self.take(resp, how)
        self.room.set()

    def failed(self, asked: int | None) -> None:
        """The call that asked could not be made: the room is free again."""
        if asked:
            self.asking -= asked
            self.room.set()

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
