"""Heartbeats: every `heartbeatSeconds` and promptly on stage changes, the node tells the controller each live
attempt's stage and which left RUN; the reply may cancel, repin, forget attempts, drain the node or hold the policy.

`daemon.NodeDaemon` runs `Heartbeater.loop`; replies act on `rollouts.Rollouts` and `llmgate.PolicyGate`.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from rolloutd.crds.node import Heartbeat, HeartbeatResponse, heartbeat_min_gap

from ..aiokit import wait_event
from .controller_client import ControllerClient, ControllerError
from .lease import Leaser
from .llmgate import PolicyGate
from .options import NodeOptions
from .outbox import Outbox
from .rollouts import Phase, Rollouts

REPINNABLE = (Phase.LEASED, Phase.INIT, Phase.WAIT_RUN)  # a backend can change until RUN starts


class Heartbeater:
    """Beats for one registered node. `on_gone(reason)`: the controller no longer knows it;
    `on_drain(why)`: it asked the node to drain."""

    def __init__(self, client: ControllerClient, opts: NodeOptions, log: logging.LoggerAdapter,
                 stats: collections.Counter[str], rollouts: Rollouts, outbox: Outbox, gate: PolicyGate, *,
                 on_gone: Callable[[str], None], on_drain: Callable[[str], None]) -> None:
        self.client, self.opts, self.log, self.stats = client, opts, log, stats
        self.rollouts, self.outbox, self.gate = rollouts, outbox, gate
        self._on_gone, self._on_drain = on_gone, on_drain
        self.node_id: str | None = None   # set once registered
        self.interval = 5.0               # from the registration
        self.wake = asyncio.Event()       # a stage changed: beat soon
        self.leaser: Leaser | None = None  # set by the daemon: beats carry its lease asks
        self._last = 0.0

    async def loop(self) -> None:
        while True:
            await wait_event(self.wake, self.interval)
            least = max(self.opts.heartbeat_min_gap, heartbeat_min_gap(self.interval))
            gap = self._last + least - time.monotonic()
            if gap > 0:
                await asyncio.sleep(gap)   # coalesce a burst of stage changes into one beat
            self.wake.clear()
            await self.beat()

    async def beat(self) -> None:
        assert self.node_id is not None
        stages = self.rollouts.stages()
        for aid in self.outbox.pending:  # finished, result not acknowledged yet: keep the lease alive
            stages.setdefault(aid, "eval")
        left = set(self.rollouts.left_run)
        self._last = time.monotonic()
        ask = self.leaser.ask() if self.leaser is not None else None
        try:
            resp = await self.client.heartbeat(self.node_id, Heartbeat(
                stages=stages, left_run=sorted(left), llm_inflight=self.gate.inflight,
                llm_held=self.gate.paused, policy_version=self.gate.version), lease=ask)
        except ControllerError as e:
            if self.leaser is not None:
                self.leaser.failed(ask)
            self.stats["heartbeat_failures"] += 1
            if e.gone:
                self._on_gone(f"heartbeat: {e}")
            else:
                self.log.warning("heartbeat: %s", e)
            return
        self.stats["heartbeats"] += 1
        self.rollouts.left_run -= left
        self.apply(resp)
        if self.leaser is not None:
            await self.leaser.answered(ask, resp.lease, "beats")

    def apply(self, resp: HeartbeatResponse) -> None:
        if resp.llm_paused != self.gate.paused or resp.policy_version != self.gate.version:
            self.log.info("policy version %s%s", resp.policy_version, " (LLM calls held)" if resp.llm_paused else "")
        self.gate.set(resp.policy_version, resp.llm_paused)
        for aid in resp.cancel:
            self.rollouts.cancel(aid, "cancelled by the controller")
        for aid in resp.unknown:
            self.rollouts.cancel(aid, "the controller no longer leases it to this node")
        for aid, url in resp.repin.items():
            r = self.rollouts.live.get(aid)
            if r is not None and r.phase in REPINNABLE:
                self.log.info("rollout %s: backend %s → %s", aid, r.backend, url)
                r.backend = url
        if resp.drain:
            self._on_drain("the controller asked this node to drain")
