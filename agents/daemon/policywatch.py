"""The policy watch (node-protocol feature policy-watch): a long-poll that hands the node's `PolicyGate` each change of
the job's policy (an update's hold, its fence, the new version) one round trip after the controller makes it.

`daemon.NodeDaemon` starts `PolicyWatcher.loop` when the controller serves the feature and points the gate's
`on_change` at `report`: the gate's changes (held, calls in flight, fence taken) go back at once on a short watch
instead of the next beat. Without the feature the heartbeat (`heartbeat.Heartbeater.apply`) carries both ways.
"""
from __future__ import annotations

import asyncio
import logging

from rolloutd.crds.kit.aiokit import Backoff
from rolloutd.crds.node import POLICY_WATCH_SECONDS, PolicyState, PolicyWatch

from .controller_client import ControllerClient, ControllerError
from .policygate import PolicyGate


class PolicyWatcher:
    """Keeps one watch pending on the controller and applies each answer to `gate`, newest only: the long-poll and
    a report (a watch with wait 0, sent when `report` is set) may be answered out of order."""

    def __init__(self, client: ControllerClient, node_id: str, gate: PolicyGate, log: logging.LoggerAdapter) -> None:
        self.client, self.node_id, self.gate, self.log = client, node_id, gate, log
        self.report = asyncio.Event()  # the gate changed: tell the controller now
        self.instance, self.epoch = "", -1  # the state applied last: (controller process, its policy epoch)
        self.answers = 0
        self.seq = 0  # numbers the watches: the controller notes the newest report only
        self.active = True  # False once the controller refused a watch

    def _body(self, wait: float) -> PolicyWatch:
        g = self.gate
        self.seq += 1
        return PolicyWatch(instance=self.instance, epoch=self.epoch, wait=wait, seq=self.seq, llm_inflight=g.inflight,
                           llm_held=g.paused, llm_fence=g.fence_done)

    def apply(self, st: PolicyState) -> None:
        self.answers += 1
        if st.instance == self.instance and st.epoch <= self.epoch:
            return  # an older answer than the one applied
        self.instance, self.epoch = st.instance, st.epoch
        if st.llm_paused != self.gate.paused or st.policy_version != self.gate.version:
            self.log.info("policy version %s%s (watch)", st.policy_version, " (LLM calls held)" if st.llm_paused else "")
        self.gate.set(st.policy_version, st.llm_paused, st.llm_fence, st.backend_versions)

    async def _call(self, wait: float) -> bool:
        """One watch; False when the controller refused it (the heartbeat notices a node it no longer knows)."""
        try:
            self.apply(await self.client.policy_watch(self.node_id, self._body(wait)))
            return True
        except ControllerError as e:
            if not e.retryable:  # the beats carry the policy from now on (`active`)
                self.log.warning("policy watch refused, the heartbeats carry the policy: %s", e)
                self.active = False
                return False
            raise

    async def loop(self) -> None:
        reports = asyncio.get_running_loop().create_task(self._reports(), name="policy-report")
        backoff = Backoff(0.2, 5.0)
        try:
            while True:
                try:
                    if not await self._call(POLICY_WATCH_SECONDS):
                        return
                    backoff.reset()
                except ControllerError as e:
                    self.log.debug("policy watch: %s", e)
                    await asyncio.sleep(backoff.next())
        finally:
            reports.cancel()

    async def _reports(self) -> None:
        while True:
            await self.report.wait()
            self.report.clear()
            try:
                if not await self._call(0.0):
                    return
            except ControllerError:
                self.report.set()  # again, after a pause
                await asyncio.sleep(0.2)
