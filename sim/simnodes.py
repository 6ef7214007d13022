"""Simulated node daemons for `python -m bench scale`: many nodes in one asyncio process, speaking
the real node protocol (register, lease, heartbeat, results) to a real controller.

Where it sits: `bench_scale.py` starts a controller and one or a few of these processes
(`python -m sim.simnodes CONFIG OUT`), each simulating a shard of the nodes. A simulated node
copies `rolloutd.agents.daemon.NodeDaemon`'s traffic without its work: leases while it has room
(long-poll `leaseWait` s), beats every `heartbeatSeconds` (what registration answers) and
promptly on a stage change (≥ `heartbeat_min_gap` apart) naming every live attempt's stage and
those that left RUN, and sends finished results in batches (coalesced `result_coalesce`: 5–250 ms by
cluster size, ≤ 64 per call); the next leases ride on beat and results replies (`?lease=N`) once the
controller answers them, the lease long-poll serving only when those come back short.
A rollout sleeps instead of running: INIT/RUN/EVAL take 5/80/15 % of a lognormal duration.
The calls go through the repo's keep-alive transport (`agents/keepalive.py`), without the
daemon's pydantic models, so a thousand nodes fit in a core or two.

Bookkeeping: `Ledger` records what the controller accepted; `audit` compares it with the
trajectories the controller delivers (lost, duplicated, phantom: all must be 0).
Next step: a node could also drop out mid-rollout (lease expiry at scale).
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Iterable

import httpx

NODES = "/apis/rolloutd.io/v1alpha1/nodes"
INIT_SHARE, RUN_SHARE = 0.05, 0.80  # of a rollout's duration; EVAL takes the rest
HEARTBEAT_MIN_GAP = 0.05  # NodeOptions.heartbeat_min_gap
RESULT_COALESCE = 0.005  # NodeOptions.result_coalesce
RESULT_BATCH = 64  # NodeOptions.result_batch
LEASE_WAIT = 1.5  # NodeOptions.lease_wait

Key = tuple[int, int]  # (prompt, sample): one rollout of the job


# ------------------------------------------------------------------ bookkeeping (unit-tested)

class Ledger:
    """What the controller told the simulated nodes: leases granted, results accepted or dropped."""

    def __init__(self) -> None:
        self.leases: dict[str, Key] = {}  # attemptId → (prompt, sample)
        self.accepted: list[Key] = []  # one entry per accepted result (a repeat is a duplicate)
        self.dropped: dict[str, str] = {}

    def leased(self, attempt_id: str, prompt: int, sample: int) -> None:
        self.leases[attempt_id] = (prompt, sample)

    def acked(self, accepted: Iterable[str], dropped: dict[str, str]) -> None:
        for aid in accepted:
            self.accepted.append(self.leases[aid])
        self.dropped.update(dropped)

    def to_json(self) -> dict:
        return {"accepted": self.accepted, "dropped": self.dropped, "leases": len(self.leases)}


@dataclass
class Audit:
    accepted: int
    delivered: int
    lost: list[Key] = field(default_factory=list)  # accepted (or expected) but never delivered
    duplicated: list[Key] = field(default_factory=list)  # accepted or delivered more than once
    phantom: list[Key] = field(default_factory=list)  # delivered, but no node's result was accepted

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.phantom)


def audit(accepted: Iterable[Key], delivered: Iterable[Key], expected: set[Key] | None = None) -> Audit:
    """Compare the results the controller acknowledged with the trajectories it serves. With
    `expected` (a finished job), every expected rollout must also be delivered."""
    acc = collections.Counter(tuple(k) for k in accepted)
    got = collections.Counter(tuple(k) for k in delivered)
    out = Audit(accepted=sum(acc.values()), delivered=sum(got.values()))
    out.duplicated = sorted({k for k, n in acc.items() if n > 1} | {k for k, n in got.items() if n > 1})
    missing = set(acc) - set(got)
    if expected is not None:
        missing |= set(expected) - set(got)
    out.lost = sorted(missing)
    out.phantom = sorted(set(got) - set(acc))
    return out


# ------------------------------------------------------------------ the wire

class Wire:
    """JSON POSTs through one keep-alive pool; latency of every call, by kind, client side."""

    def __init__(self, base: str, token: str, connections: int) -> None:
        from rolloutd.agents.keepalive import KeepAliveTransport

        self.base = base.rstrip("/") + NODES
        self.headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self.transport = KeepAliveTransport(max_connections=connections, max_keepalive=connections)
        self.latency: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)  # kind → (start, s)
        self.errors: collections.Counter[str] = collections.Counter()

    async def post(self, kind: str, path: str, body: bytes, timeout: float = 60.0, token: str | None = None) -> dict:
        """`token`: the node's own (per-node calls); else the job's node credential (register)."""
        headers = self.headers if token is None else {**self.headers, "Authorization": f"Bearer {token}"}
        req = httpx.Request("POST", self.base + path, content=body, headers=headers,
                            extensions={"timeout": {"connect": 10, "read": timeout, "write": 10, "pool": timeout}})
        t0 = time.time()
        try:
            resp = await self.transport.handle_async_request(req)
        except httpx.HTTPError as e:
            self.errors[f"{kind} {type(e).__name__}"] += 1
            raise
        self.latency[kind].append((t0, time.time() - t0))
        if resp.status_code >= 400:
            self.errors[f"{kind} {resp.status_code}"] += 1
            raise RuntimeError(f"{kind}: HTTP {resp.status_code}: {resp.content[:300]!r}")
        return json.loads(resp.content) if resp.content else {}


# ------------------------------------------------------------------ one simulated node

def spaced(gap: float, rng: random.Random) -> float:
    """The daemon's wait before its next paced beat (`rolloutd.crds.node.spaced_gap`)."""
    from rolloutd.crds.node import spaced_gap

    return spaced_gap(gap, rng.random())


class SimNode:
    def __init__(self, sim: "Shard", name: str, slot: int) -> None:
        self.sim, self.name, self.slot = sim, name, slot
        self.node_id = ""
        self.token: str | None = None  # the node's own token (a controller that hands none out: the job's)
        self.hb_interval = 0.5
        self.stages: dict[str, str] = {}  # attemptId → wire stage of every live rollout
        self.left_run: set[str] = set()
        self.outbox: dict[str, bytes] = {}  # finished, not yet acknowledged
        self.live = 0
        self.started = 0  # rollouts leased so far (the first `slots` start mid-way: a steady state)
        self.room = asyncio.Event()
        self.hb_wake = asyncio.Event()
        self.out_wake = asyncio.Event()
        self.last_hb = 0.0
        # leases riding on beat and results replies, as the daemon's `Leaser` does (None: support not known yet)
        self.piggyback: bool | None = None if sim.cfg.get("piggyback", True) else False
        self.asking = 0
        self.starved = False
        # one call per beat (beat-results + beat-deltas, when the controller serves them): results ride on beats,
        # change-prompted beats name only what changed since the last answered one, beats ≥ `gap` apart
        self.sync = False
        self.gap = self.spaced = 0.0
        self.told: dict[str, str] = {}  # attemptId → the stage the last answered beat told
        self.last_full = 0.0

    async def register(self) -> None:
        body = json.dumps({"job": self.sim.job, "protocol": self.sim.protocol, "name": self.name,
                           "host": "sim", "pid": 0, "slot": self.slot}).encode()
        query = "?features=beat-results,beat-deltas,node-token" if self.sim.cfg.get("sync", True) \
            else "?features=node-token"
        resp = await self.sim.wire.post("register", f"/register{query}", body)
        self.token = resp.get("nodeToken")
        self.node_id, self.hb_interval = resp["nodeId"], max(resp["heartbeatSeconds"] / self.sim.factor, 0.005)
        self.coalesce = self.sim.coalesce(resp["heartbeatSeconds"])
        self.sync = "beat-results" in (resp.get("features") or ())
        self.gap = self.sim.min_gap(self.hb_interval)

    def free(self) -> int:
        return self.sim.slots - self.live - self.asking

    async def lease_loop(self) -> None:
        while True:
            room = self.free()
            if room <= 0 or (self.piggyback and not self.starved):
                if room > 0:
                    self.hb_wake.set()  # the next beat or results call asks for the room
                self.room.clear()
                await self.room.wait()
                continue
            body = json.dumps({"maxItems": room, "wait": LEASE_WAIT / self.sim.factor}).encode()
            self.asking += room
            try:
                resp = await self.sim.wire.post("lease", f"/{self.node_id}/lease", body, token=self.token)
            except Exception:  # noqa: BLE001 - counted in Wire.errors; the daemon retries too
                await asyncio.sleep(0.2)
                continue
            finally:
                self.asking -= room
            leases = resp.get("leases", [])
            if not leases:
                self.sim.empty_leases += 1
            self.starved = len(leases) < room
            for lease in leases:
                self.start(lease)

    def ask(self) -> str:
        """`?lease=N` for a beat or results call (the daemon's `Leaser.ask`), with `asking` counted."""
        if self.piggyback is False:
            return ""
        n = self.free()
        if n <= 0:
            return "?lease=0" if self.piggyback is None else ""
        self.asking += n
        return f"?lease={n}"

    def answered(self, query: str, resp: dict | None) -> None:
        if not query:
            return
        asked = int(query.split("=")[1])
        self.asking -= asked
        if resp is not None:
            if "lease" not in resp:
                self.piggyback = False  # an older controller: lease by our own calls
            else:
                self.piggyback = True
                leases = resp["lease"].get("leases", [])
                self.starved = len(leases) < asked
                self.sim.piggybacked += len(leases)
                for lease in leases:
                    self.start(lease)
        self.room.set()

    def start(self, lease: dict) -> None:
        aid = lease["attemptId"]
        self.sim.ledger.leased(aid, lease["prompt"], lease["sample"])
        first = self.started < self.sim.slots
        d = self.sim.duration(length_biased=first)
        elapsed = 0.0
        if first:  # the first fill enters the steady state: a rollout caught mid-way (longer ones more likely)
            elapsed = self.sim.rng.random() * d
        self.started += 1
        self.live += 1
        t0 = time.time() - elapsed
        stamps = {"init": t0, "run": t0 + INIT_SHARE * d, "eval": t0 + RUN_SHARE * d}
        loop = asyncio.get_running_loop()
        self.set_stage(aid, "init")
        if elapsed < INIT_SHARE * d:
            loop.call_later(INIT_SHARE * d - elapsed, self.set_stage, aid, "run")
        else:
            self.stages[aid] = "run"
        if elapsed < RUN_SHARE * d:
            loop.call_later(RUN_SHARE * d - elapsed, self.leave_run, aid)
        else:
            self.stages[aid] = "eval"
        loop.call_later(d - elapsed, self.finish, aid, lease, stamps, d)

    def set_stage(self, aid: str, stage: str) -> None:
        if aid in self.stages or stage == "init":  # else cancelled by the controller meanwhile
            self.stages[aid] = stage
            self.hb_wake.set()

    def leave_run(self, aid: str) -> None:
        if aid in self.stages:
            self.left_run.add(aid)
            self.set_stage(aid, "eval")

    def finish(self, aid: str, lease: dict, stamps: dict, d: float) -> None:
        if self.stages.pop(aid, None) is None:
            return
        self.live -= 1
        self.room.set()
        self.hb_wake.set()
        self.outbox[aid] = self.sim.result(aid, lease, self.name, stamps, d)
        (self.hb_wake if self.sync else self.out_wake).set()

    async def heartbeat_loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self.hb_wake.wait(), self.hb_interval)
            except TimeoutError:
                pass
            gap = self.last_hb + self.sim.min_gap(self.hb_interval) - time.monotonic()
            if gap > 0:
                await asyncio.sleep(gap)  # coalesce a burst of stage changes into one beat
            self.hb_wake.clear()
            stages = dict(self.stages)
            for aid in self.outbox:
                stages.setdefault(aid, "eval")
            left = sorted(self.left_run)
            self.last_hb = time.monotonic()
            body = json.dumps({"stages": stages, "leftRun": left, "llmInflight": 0, "llmHeld": False,
                               "policyVersion": None}, separators=(",", ":")).encode()
            query = self.ask()
            try:
                resp = await self.sim.wire.post("heartbeat", f"/{self.node_id}/heartbeat{query}", body, token=self.token)
            except Exception:  # noqa: BLE001
                self.answered(query, None)
                continue
            self.answered(query, resp)
            self.left_run.difference_update(left)
            for aid in resp.get("cancel", []) + resp.get("unknown", []):
                if self.stages.pop(aid, None) is not None:  # forgotten: its timers find nothing to do
                    self.sim.cancelled += 1  # (one just acknowledged and named in the beat is no news)
                    self.live -= 1
                    self.room.set()
                self.outbox.pop(aid, None)

    async def sync_loop(self) -> None:
        """The daemon's beats with beat-results and beat-deltas: every change (a stage, a finished result, free
        room) prompts a beat at most every `gap` (the controller's beatGap); every `hb_interval` a full one."""
        inflight: set[str] = set()
        while not self.sim.stopping:
            due = self.last_full + self.hb_interval - time.monotonic()
            if due > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.hb_wake.wait(), due)
            wait = self.last_hb + self.spaced - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if self.sim.stopping:  # the run is over: nothing new is sent (a call in flight was answered)
                return
            self.hb_wake.clear()
            now = time.monotonic()
            full = now - self.last_full >= self.hb_interval
            batch = [(aid, b) for aid, b in self.outbox.items() if aid not in inflight][:RESULT_BATCH]
            if full:
                stages = dict(self.stages)
                for aid in self.outbox:
                    stages.setdefault(aid, "eval")
            else:
                stages = {aid: st for aid, st in self.stages.items() if self.told.get(aid) != st}
            left = sorted(self.left_run)
            head = json.dumps({"stages": stages, "leftRun": left, "llmInflight": 0, "llmHeld": False,
                               "policyVersion": None, "full": full}, separators=(",", ":")).encode()
            body = head[:-1] + b',"results":[' + b",".join(b for _, b in batch) + b"]}"
            query = self.ask()
            inflight.update(aid for aid, _ in batch)
            self.last_hb = now
            try:
                resp = await self.sim.wire.post("heartbeat", f"/{self.node_id}/heartbeat{query}", body, token=self.token)
            except Exception:  # noqa: BLE001 - counted in Wire.errors; the next beat carries it all again
                self.answered(query, None)
                inflight.difference_update(aid for aid, _ in batch)
                continue
            inflight.difference_update(aid for aid, _ in batch)
            if full:
                self.last_full = now
                self.told = dict(stages)
            else:
                self.told.update(stages)
            self.gap = max(resp.get("beatGap") or 0.0, 0.0) / self.sim.factor
            self.spaced = spaced(self.gap, self.sim.rng)
            self.answered(query, resp)
            self.left_run.difference_update(left)
            accepted, dropped = resp.get("accepted") or [], resp.get("dropped") or {}
            for aid, _ in batch:
                self.outbox.pop(aid, None)
                self.told.pop(aid, None)
            self.sim.ledger.acked(accepted, dropped)
            self.sim.accepted_at.extend([time.time()] * len(accepted))
            for aid in resp.get("cancel", []) + resp.get("unknown", []):
                if self.stages.pop(aid, None) is not None:
                    self.sim.cancelled += 1
                    self.live -= 1
                    self.room.set()
                self.told.pop(aid, None)
                self.outbox.pop(aid, None)
            if self.outbox or any(self.told.get(a) != st for a, st in self.stages.items()):
                self.hb_wake.set()

    async def result_loop(self) -> None:
        while True:
            await self.out_wake.wait()
            await asyncio.sleep(self.coalesce)
            if self.sim.stopping:  # the run is over: nothing new is sent (a call in flight was answered)
                return
            self.out_wake.clear()
            batch = list(self.outbox.items())[:RESULT_BATCH]
            body = b'{"results":[' + b",".join(b for _, b in batch) + b"]}"
            query = "" if self.sim.stopping else self.ask()
            try:
                ack = await self.sim.wire.post("results", f"/{self.node_id}/results{query}", body, token=self.token)
            except Exception:  # noqa: BLE001 - kept in the outbox, sent again
                self.answered(query, None)
                await asyncio.sleep(0.2)
                self.out_wake.set()
                continue
            self.answered(query, ack)
            now = time.time()
            for aid, _ in batch:
                self.outbox.pop(aid, None)
            self.sim.ledger.acked(ack.get("accepted", []), ack.get("dropped", {}))
            self.sim.accepted_at.extend([now] * len(ack.get("accepted", [])))
            if self.outbox:
                self.out_wake.set()


# ------------------------------------------------------------------ a shard of nodes in this process

class Shard:
    def __init__(self, cfg: dict) -> None:
        from rolloutd.crds.node import NODE_PROTOCOL

        self.cfg = cfg
        self.job, self.slots, self.factor = cfg["job"], cfg["slots"], cfg["time_factor"]
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

            return max(HEARTBEAT_MIN_GAP, heartbeat_min_gap(interval * self.factor)) / self.factor
        return HEARTBEAT_MIN_GAP / self.factor

    def coalesce(self, heartbeat_seconds: float) -> float:
        """The daemon's results coalescing window (grown with the cluster, `crds.node.result_coalesce`;
        a fixed 5 ms for daemons before it), in simulated seconds."""
        if self.cfg.get("piggyback", True):
            from rolloutd.crds.node import result_coalesce

            return max(RESULT_COALESCE, result_coalesce(heartbeat_seconds)) / self.factor
        return RESULT_COALESCE / self.factor

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
