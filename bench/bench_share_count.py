"""What a lease's fair share costs when a job names 1000 nodes × 64 slots: the controller's own lease path
(`Attempts.lease_now`, real store, real scheduler) with the share's count as it was (the job's live items counted up
to what the share needs: ~63 000 index entries on every lease) and as it is (the leases held in memory, the queue
counted only as far as needed), side by side on the same database state, on each store.

`python -m bench share_count` (`$ROLLOUTD_SHARE_STORES`: sqlite,postgresql). Two phases per run: the first wave (1000
nodes each leasing 64 of 160 000 queued items) and the steady state (each node gives one back and leases one again).
`bench scale` does not see this: its simulated nodes join a job that names no nodes (`executor.nodes: 0`), where
there is no share to count. Results: bench/results/RESULTS-scale.md.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

from rolloutd.controller.store import Store
from rolloutd.controller.work.node_share import NodeShares
from rolloutd.controller.work.core import build_work
from rolloutd.controller.work.scheduler import Scheduler
from rolloutd.crds.node import NODE_PROTOCOL, RegisterRequest
from rolloutd.crds.rolloutjob import RolloutJob

NODES, SLOTS, PROMPTS, SAMPLES = 1000, 64, 20_000, 8


def before(self, db, node_id, job_name, nodes, asked):
    """The share as it was (40f49a7 and earlier): the job's live items counted on every lease."""
    if nodes <= 1 or asked <= 0:
        return asked, None
    held = self.held.held(node_id)
    enough = nodes * (asked + held - 1) + 1
    live = self.queue.count_live(db, job_name, enough)
    if live >= enough:
        return asked, live
    return max(0, min(asked, -(-live // nodes) - held)), live


def job_doc(source: Path) -> dict:
    return {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": "share"},
            "spec": {"tasks": {"kind": "math", "source": str(source)}, "samplesPerPrompt": SAMPLES,
                     "agent": {"kind": "oracle"}, "pipeline": {"leaseSeconds": 3600},
                     "executor": {"kind": "local", "nodes": NODES}}}


def one(location: str, variant: str, source: Path) -> dict:
    store = Store(location)
    store.apply(RolloutJob.model_validate(job_doc(source)))
    sched = Scheduler(build_work(store))
    sched.work.expansions.expand(store.get("share"))
    attempts = sched.work.attempts
    nodes = [sched.work.registry.register(RegisterRequest(job="share", protocol=NODE_PROTOCOL, name=f"n{i}")).node_id
             for i in range(NODES)]
    patch = mock.patch.object(NodeShares, "share", before) if variant == "before" else contextlib.nullcontext()
    with patch:
        t = time.perf_counter()
        held = {n: [lease.attempt_id for lease in attempts.lease_now(n, SLOTS).leases] for n in nodes}
        wave = time.perf_counter() - t
        steady = 0.0
        for n in nodes:
            attempts.give_back(n, held[n][:1], "bench")
            t = time.perf_counter()
            got = attempts.lease_now(n, 1).leases
            steady += time.perf_counter() - t
            assert len(got) == 1
    granted = sum(len(v) for v in held.values())
    assert granted == NODES * SLOTS, granted
    store.engine.dispose()
    return {"variant": variant, "wave_s": wave, "wave_ms_per_lease": wave / NODES * 1e3,
            "steady_ms_per_lease": steady / NODES * 1e3}


def run(quick: bool = False) -> list[dict]:
    from bench import scale_stores

    stores = os.environ.get("ROLLOUTD_SHARE_STORES", "sqlite,postgresql").split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="rolloutd-bench-share-") as tmp:
        source = Path(tmp) / "tasks.jsonl"
        source.write_text("".join(json.dumps({"id": i, "question": "?", "answer": "1"}) + "\n" for i in range(PROMPTS)))
        for store in stores:
            server = scale_stores.start_server() if store == "postgresql" else None
            try:
                got = {}
                for i, variant in enumerate(("before", "now")):
                    where = server.create_database(f"share{i}") if server else str(Path(tmp) / f"{variant}.db")
                    got[variant] = one(where, variant, source)
                    print(f"   {store} {variant}: {json.dumps(got[variant])}", flush=True)
            finally:
                if server:
                    server.stop()
            b, n = got["before"], got["now"]
            for phase, key in (("first wave (1000 leases of 64)", "wave_ms_per_lease"),
                               ("steady state (1000 leases of 1)", "steady_ms_per_lease")):
                rows.append({"benchmark": f"a lease with the fair share, {store}, a job of {NODES} nodes × {SLOTS}, "
                                          f"{phase}",
                             "ours": f"{n[key]:.2f} ms", "baseline": f"{b[key]:.2f} ms (live items counted)",
                             "ratio": b[key] / max(n[key], 1e-6), "target": "reported", "met": None})
    return rows
