"""Heartbeats: every `heartbeatSeconds` and promptly on stage changes, the node tells the controller each live
attempt's stage and which left RUN; the reply may cancel, repin, forget attempts, drain the node or hold the policy.
A controller that has not answered for `UNREACHABLE_LEASES` × leaseSeconds + `ROLLOUTD_CONTROLLER_START_SECONDS` is given up:
the node is lost (exit 1).

With the features the controller serves (`crds.node.FEATURES`): beat-results, beats carry finished results (from
`outbox.Outbox`, acknowledged by the reply) and come no closer than the reply's `beatGap`; beat-deltas, a beat
prompted by a change names only the stages changed since the last answered beat (`beatbody.ToldStages`), the
timed ones every live lease; policy-watch, the job's policy comes by `policywatch.PolicyWatcher`, not on the replies.
`daemon.NodeDaemon` runs `Heartbeater.loop`; replies act on `rollouts.Rollouts` and
`policygate.PolicyGate`.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Callable

from rolloutd.crds.node import Heartbeat, HeartbeatResponse, heartbeat_min_gap, spaced_gap

from rolloutd.crds.kit.aiokit import Backoff, wait_event
from .beatbody import ToldStages, beat_body
from .controller_client import ControllerClient, ControllerError
from .lease import Leaser
from .policygate import PolicyGate
from .policywatch import PolicyWatcher
from .options import NodeOptions
from .outbox import Outbox
from .rollouts import Phase, Rollouts

OUTAGE_LEASES = 10  # a controller away (stopped, restarting, unreachable) this many leaseSeconds loses nothing
# a daemon the controller has not answered for this many leaseSeconds exits (LOST): twice the outage it rides
# through, so the beat's back-off, the controller's start and its lease grace fit inside (#37: at 10 the two
# rules met, and a 10 × outage was lost to the daemons leaving)
UNREACHABLE_LEASES = 2 * OUTAGE_LEASES


def unreachable_after(lease_seconds: float, start_seconds: float) -> float:
    """Seconds without an answer after which a daemon gives its controller up: the lease rule plus the controller's
    own start, which does not scale with leaseSeconds (`ROLLOUTD_CONTROLLER_START_SECONDS`, crds/nodeenv.py)."""
    return UNREACHABLE_LEASES * lease_seconds + start_seconds


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
        gate.tokens.ask = lambda: self.wake.set()  # token-share: a call to a backend no reply named waits for one
        self.leaser: Leaser | None = None  # set by the daemon: beats carry its lease asks
        self.deltas = False                # beat-deltas served (set at registration)
        self.turns = False                 # beat-turns served (set at registration)
        self.tokens = False                # token-share served (set at registration)
        self.work = False                  # work-share served (set at registration)
        self.watcher: PolicyWatcher | None = None  # policy-watch served: the policy comes by it, not by beats
        self.beat_gap: float | None = None  # the controller's pacing, from beat-results replies
        self.unreachable_after: float | None = None  # set from the spec (`unreachable_after`)
        self.reached = time.monotonic()    # when the controller last answered a beat
        self._told = ToldStages()
        self._last = 0.0                   # when the last beat was sent
        self._last_full = 0.0              # ... and the last full one (beat-deltas: the next timed beat is due)
        self._one_at_a_time = asyncio.Lock()  # the loop's beat and the daemon's last one at exit
        self._retry = Backoff(0.2, opts.retry_max)  # after a failed beat: no beat before `_retry_at`
        self._retry_at = 0.0

    def gate_changed(self) -> None:
        """The policy gate changed (held, calls in flight, a fence taken): tell the controller now, on the policy
        watch when there is one, else on a beat."""
        (self.watcher.report if self.watching else self.wake).set()

    @property
    def watching(self) -> bool:
        return self.watcher is not None and self.watcher.active

    def least_gap(self) -> float:
        """Beats come no closer than this: the controller's `beatGap` once it gave one (`spaced_gap` of it, drawn
        at each reply), else a share of the interval."""
        pacing = self.beat_gap if self.beat_gap is not None else heartbeat_min_gap(self.interval)
        return max(self.opts.heartbeat_min_gap, pacing)

    def _until_timed_beat(self) -> float:
        if not self.deltas:
            return self.interval
        # change-prompted beats do not renew leases: the timed beat is due an interval after the last full one
        return self._last_full + self.interval - time.monotonic()

    async def loop(self) -> None:
        while True:
            timed = not await wait_event(self.wake, self._until_timed_beat())
            await self.beat(timed=timed)

    async def beat(self, *, timed: bool = False) -> None:
        async with self._one_at_a_time:
            gap = max(self._last + self.least_gap(), self._retry_at) - time.monotonic()
            if gap > 0:
                await asyncio.sleep(gap)   # coalesce a burst of stage changes (and results) into one beat
            self.wake.clear()
            await self._beat(timed)

    async def _beat(self, timed: bool) -> None:
        assert self.node_id is not None
        stages = self.rollouts.stages()
        for aid in self.outbox.pending:  # finished, result not acknowledged yet: keep the lease alive
            stages.setdefault(aid, "eval")
        left = set(self.rollouts.left_run)
        now = self._last = time.monotonic()
        full = not self.deltas or timed or self._told.full_due(now, self.interval)
        if full:
            self._last_full = now
        carried = self.outbox.take_for_beat()
        aids = [aid for aid, _ in carried]
        hb = Heartbeat(stages=stages if full else self._told.changed(stages), left_run=sorted(left),
                       llm_inflight=self.gate.inflight, llm_held=self.gate.paused, policy_version=self.gate.version,
                       llm_fence=self.gate.fence_done,
                       full=full, turns=self.rollouts.turns() if self.turns else {},
                       llm_tokens=self.gate.tokens.report(self.gate.rates.wanted) if self.tokens else {})
        if self.work:
            hb.llm_processed, hb.llm_rate_held = self.gate.rates.report()
        ask = self.leaser.ask() if self.leaser is not None else None
        try:
            resp = await self.client.heartbeat(self.node_id, beat_body(hb, [body for _, body in carried],
                                                                       deltas=self.deltas, turns=self.turns,
                                                                       tokens=self.tokens, work=self.work), lease=ask)
        except ControllerError as e:
            # stage changes and results wake the loop often: while the controller is away, beats back off
            self._retry_at = time.monotonic() + min(self._retry.next(), self.interval)
            self._failed(e, ask, aids)
            return
        finally:
            self.outbox.release(aids)  # settled below, before any other task runs
        self._retry.reset()
        self._retry_at = 0.0
        self.stats["heartbeats"] += 1
        self._slow(now, resp.lease_seconds)
        self.reached = time.monotonic()
        if self.deltas:
            self.stats["full_beats" if full else "delta_beats"] += 1
            self._told.answered(stages, full=full, sent_at=now)
        self.rollouts.left_run -= left
        if aids:
            self.outbox.beat_answered(aids, resp)
        if resp.beat_gap is not None:  # paced: a random share of it, so daemons answered together spread out
            self.beat_gap = spaced_gap(resp.beat_gap, random.random())
        self.apply(resp)
        if self.gate.paused and self.gate.mode != "drain" and not self.watching:  # a live update: its steps wait on our beats, beat again
            self.wake.set()
        if self.leaser is not None:
            await self.leaser.answered(ask, resp.lease, "beats")

    def _slow(self, sent: float, lease_seconds: float) -> None:
        """A beat answered more than half a lease after the one before: say whose time it was (this daemon late to
        send, or the controller late to answer), before the lease it renews runs out."""
        answered = time.monotonic()
        if answered - self.reached > lease_seconds / 2:
            self.log.warning("no beat answered for %.1f s (lease %g s): sent %.1f s after the last answer, answered "
                             "%.1f s after it was sent", answered - self.reached, lease_seconds, sent - self.reached,
                             answered - sent)

    def _failed(self, e: ControllerError, ask: int | None, carried: list[str]) -> None:
        """Nothing the beat carried counts as told: the next beat carries its stages and results again."""
        if self.leaser is not None:
            self.leaser.failed(ask)
        self.stats["heartbeat_failures"] += 1
        if e.gone:
            self._on_gone(f"heartbeat: {e}")
            return
        self.log.warning("heartbeat: %s", e)
        silent = time.monotonic() - self.reached
        if self.unreachable_after is not None and silent > self.unreachable_after:
            # the controller is gone for good (stopped, its host lost): a daemon must not outlive it for ever
            self._on_gone(f"the controller has not answered for {silent:.0f} s ({UNREACHABLE_LEASES} × "
                          f"spec.pipeline.leaseSeconds + {self.opts.controller_start_seconds:g} s for its start): leaving, "
                          "its sandboxes ended")
            return
        if carried and not e.retryable:
            # refused (too large, or a result it cannot take): the results go by POST …/results, which splits a
            # batch and stands in for a result refused alone; the stages go again on the next beat, without them
            self.log.warning("heartbeat refused with %d result(s) on it: sending them by POST …/results",
                             len(carried))
            self.outbox.beat_refused(carried)
            self.wake.set()

    def apply(self, resp: HeartbeatResponse) -> None:
        if resp.llm_paused != self.gate.paused or resp.policy_version != self.gate.version:
            self.log.info("policy version %s%s", resp.policy_version, " (LLM calls held)" if resp.llm_paused else "")
        if not self.watching:  # policy-watch: the watch's answers, which are never older than a beat's, set it
            self.gate.set(resp.policy_version, resp.llm_paused, resp.llm_fence, resp.backend_versions)
        self.gate.tokens.set(resp.llm_tokens, self.tokens)  # token-share: the job's allowances
        self.gate.rates.set(resp.llm_rates, self.work)  # work-share: the job's processed tokens per second
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
