"""Simulated node daemons for `python -m bench scale`: many nodes in one asyncio process, speaking
the real node protocol (register, lease, heartbeat, results) to a real controller.

Where it sits: `bench_scale.py` starts a controller and one or a few of these processes
(`python -m support.sim.simnodes CONFIG OUT`), each simulating a shard of the nodes. A simulated node
copies `rolloutd.agents.daemon.NodeDaemon`'s traffic without its work: leases while it has room
(long-poll `leaseWait` s), beats every `heartbeatSeconds` (what registration answers) and
promptly on a stage change (≥ `heartbeat_min_gap` apart) naming every live attempt's stage and
those that left RUN, and sends finished results in batches (coalesced `result_coalesce`: 5–250 ms by
cluster size, ≤ 64 per call); the next leases ride on beat and results replies (`?lease=N`) once the
controller answers them, the lease long-poll serving only when those come back short.
A rollout sleeps instead of running: INIT/RUN/EVAL take 5/80/15 % of a lognormal duration.
The calls go through the repo's keep-alive transport (`agents/keepalive.py`), without the
daemon's pydantic models, so a thousand nodes fit in a core or two.

Bookkeeping (`ledger.py`): `Ledger` records what the controller accepted; `audit` compares it with the
trajectories the controller delivers (lost, duplicated, phantom: all must be 0).
Next step: a node could also drop out mid-rollout (lease expiry at scale).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time

from .ledger import Ledger
from .node import HEARTBEAT_MIN_GAP, INIT_SHARE, RESULT_COALESCE, RUN_SHARE, SimNode, Wire


# ------------------------------------------------------------------ a shard of nodes in this process

class Shard:
    def __init__(self, cfg: dict) -> None:
        from rolloutd.crds.node import NODE_PROTOCOL

        self.cfg = cfg
        self.job, self.slots, self.factor = cfg["job"], cfg["slots"], cfg["time_factor"]
        # the protocol's timings (beats, gaps, lease waits) scaled as the durations are, or (`durations_only`) kept
        # at the daemon's: with a factor below 1, scaled beat gaps outlast the controller's leases
        self.pace = 1.0 if cfg.get("durations_only") else self.factor
        self.protocol = NODE_PROTOCOL
        self.rng = random.Random(cfg.get("seed", 0))
        self.wire = Wire(cfg["url"], cfg["credential"], connections=4 * cfg["nodes"] + 8)
        self.ledger = Ledger()
        self.accepted_at: list[float] = []
        self.empty_leases = self.cancelled = self.piggybacked = 0
        self.stopping = False
        self.template = self._template()

    def min_gap(self, interval: float) -> float:
        """The daemon's least gap between beats (`scaled_gap`: the rule of crds.node, else the fixed 50 ms
        of daemons before it), in simulated seconds."""
        if self.cfg.get("scaled_gap", True):
            from rolloutd.crds.node import heartbeat_min_gap

            return max(HEARTBEAT_MIN_GAP, heartbeat_min_gap(interval * self.pace)) / self.pace
        return HEARTBEAT_MIN_GAP / self.pace

    def coalesce(self, heartbeat_seconds: float) -> float:
        """The daemon's results coalescing window (grown with the cluster, `crds.node.result_coalesce`;
        a fixed 5 ms for daemons before it), in simulated seconds."""
        if self.cfg.get("piggyback", True):
            from rolloutd.crds.node import result_coalesce

            return max(RESULT_COALESCE, result_coalesce(heartbeat_seconds)) / self.pace
        return RESULT_COALESCE / self.pace

    def duration(self, length_biased: bool = False) -> float:
        """Seconds of one rollout: lognormal around `median_seconds`, divided by the time factor.
        `length_biased`: the duration of a rollout found running at a random moment (a lognormal's
        length-biased law is the same lognormal with its median × e^σ²)."""
        sigma = self.cfg["sigma"]
        median = self.cfg["median_seconds"] * (math.exp(sigma ** 2) if length_biased else 1.0)
        return median * math.exp(self.rng.gauss(0.0, sigma)) / self.factor

    def _template(self) -> dict:
        from rolloutd.crds.trajectory import Trajectory

        # what bench-noop's handler and the daemon's _finish put in a trajectory
        return Trajectory(job=self.job, prompt=0, sample=0, task_id="t", finish_reason="stop", reward=1.0,
                          node="sim").wire()

    def result(self, aid: str, lease: dict, node: str, stamps: dict, d: float) -> bytes:
        t = dict(self.template)
        t.update(prompt=lease["prompt"], sample=lease["sample"], attempt=lease["attempt"], node=node,
                 taskId=str(lease["task"].get("id")), policyVersion=lease.get("policyVersion"))
        t["timings"] = {"queue": lease.get("queuedSeconds", 0.0), "init": INIT_SHARE * d,
                        "run": (RUN_SHARE - INIT_SHARE) * d, "eval": (1 - RUN_SHARE) * d,
                        "stamps": {**stamps, "end": time.time()}}
        return json.dumps({"attemptId": aid, "trajectory": t}, separators=(",", ":")).encode()

    async def run(self) -> dict:
        cfg = self.cfg
        nodes = [SimNode(self, f"sim{cfg['first'] + i}", cfg["first"] + i) for i in range(cfg["nodes"])]
        sem = asyncio.Semaphore(64)  # registration burst: the way a big allocation starts, not all at once

        async def register(n: SimNode) -> None:
            async with sem:
                await n.register()

        await asyncio.gather(*(register(n) for n in nodes))
        await asyncio.sleep(max(cfg["start_at"] - time.time(), 0))
        tasks = [asyncio.create_task(n.lease_loop()) for n in nodes]
        tasks += [asyncio.create_task(n.heartbeat_loop()) for n in nodes if not n.sync]
        senders = [asyncio.create_task(n.sync_loop() if n.sync else n.result_loop()) for n in nodes]
        failed: list[str] = []

        def watch(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None:
                failed.append(repr(t.exception())[:300])

        for t in tasks + senders:
            t.add_done_callback(watch)
        await asyncio.sleep(max(cfg["stop_at"] - time.time(), 0))
        for t in tasks:
            t.cancel()
        self.stopping = True  # results in flight get their answer (else accepted but not in the ledger)
        for n in nodes:
            n.out_wake.set()
            n.hb_wake.set()
        await asyncio.wait(senders, timeout=60)
        for t in senders:
            t.cancel()
        # bounded: a cancelled call inside the keep-alive pool sometimes never returned, and the shard hung
        await asyncio.wait(tasks + senders, timeout=30)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.wire.transport.aclose(), 10)
        return {"ledger": self.ledger.to_json(), "accepted_at": self.accepted_at,
                "latency": {k: v for k, v in self.wire.latency.items()}, "errors": dict(self.wire.errors),
                "forwarded": self.wire.forwarded, "redirected": self.wire.redirected,
                "failed_loops": failed[:10], "n_failed_loops": len(failed),
                "empty_leases": self.empty_leases, "cancelled": self.cancelled, "piggybacked": self.piggybacked}


def main(argv: list[str]) -> int:
    cfg = json.loads(open(argv[0]).read())
    # not asyncio.run: its clean-up waits for every leftover task, and one stuck in a cancelled call hung the shard
    out = asyncio.new_event_loop().run_until_complete(Shard(cfg).run())
    with open(argv[1], "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
