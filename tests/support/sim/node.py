"""One simulated node daemon (`SimNode`) and its wire (`Wire`: JSON POSTs through the daemon's own keep-alive
transport, latency by call kind): register, lease, beat and send results as `rolloutd.agents.daemon` would.

Driven by `simnodes.Shard`, many to a process. Next step: a node that drops out mid-rollout.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import random
import time
from typing import Any

import httpx

NODES = "/apis/rolloutd.io/v1alpha1/nodes"
INIT_SHARE, RUN_SHARE = 0.05, 0.80  # of a rollout's duration; EVAL takes the rest
HEARTBEAT_MIN_GAP = 0.05  # NodeOptions.heartbeat_min_gap
RESULT_COALESCE = 0.005  # NodeOptions.result_coalesce
RESULT_BATCH = 64  # NodeOptions.result_batch
LEASE_WAIT = 1.5  # NodeOptions.lease_wait


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
        self.owners: dict[str, str] = {}  # node id → the replica that owns it (named on a forwarded reply), as daemons
        self.forwarded = 0  # calls answered through another replica (node shards: `controller/ha/shards.py`)
        self.redirected = 0  # calls answered 421 by another replica, re-sent to the owner it named (owner-redirect)

    async def post(self, kind: str, path: str, body: bytes, timeout: float = 60.0, token: str | None = None) -> dict:
        """`token`: the node's own (per-node calls); else the job's node credential (register)."""
        headers = self.headers if token is None else {**self.headers, "Authorization": f"Bearer {token}"}
        node = path.split("/", 2)[1].split("?", 1)[0]
        t0 = time.time()
        for _ in range(4):  # feature owner-redirect: a 421 processed nothing, re-sent to the owner it names
            req = httpx.Request("POST", self.owners.get(node, self.base) + path, content=body, headers=headers,
                                extensions={"timeout": {"connect": 10, "read": timeout, "write": 10, "pool": timeout}})
            try:
                resp = await self.transport.handle_async_request(req)
            except httpx.HTTPError as e:
                self.errors[f"{kind} {type(e).__name__}"] += 1
                raise
            if resp.status_code != 421 or resp.headers.get("x-rolloutd-owner") is None:
                break
            self.owners[node] = resp.headers["x-rolloutd-owner"].rstrip("/") + NODES
            self.redirected += 1
        self.latency[kind].append((t0, time.time() - t0))
        if (owner := resp.headers.get("x-rolloutd-owner")) is not None and resp.status_code != 421:  # OWNER_HEADER
            self.owners[node], self.forwarded = owner.rstrip("/") + NODES, self.forwarded + 1
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
    def __init__(self, sim: Any, name: str, slot: int) -> None:
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
        query = "?features=beat-results,beat-deltas,node-token,owner-redirect" if self.sim.cfg.get("sync", True) \
            else "?features=node-token,owner-redirect"
        resp = await self.sim.wire.post("register", f"/register{query}", body)
        self.token = resp.get("nodeToken")
        self.node_id, self.hb_interval = resp["nodeId"], max(resp["heartbeatSeconds"] / self.sim.pace, 0.005)
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
            body = json.dumps({"maxItems": room, "wait": LEASE_WAIT / self.sim.pace}).encode()
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
            self.gap = max(resp.get("beatGap") or 0.0, 0.0) / self.sim.pace
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
