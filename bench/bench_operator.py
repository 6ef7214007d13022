"""Reconcile latency: apply → `Provisioning` and last rollout → `Succeeded`, with this checkout's kopf
handlers side by side with the hand-written loop they replaced (the branch's base, from `git archive`).

    python -m bench operator            (ROLLOUTD_BENCH_BASE=<rev> picks the "before" revision;
                                         writes bench/results/RESULTS-operator.md)

One controller per variant (`--executors local`, jobs of `nodes: 0`: no daemon process, the node is
simulated over the real node protocol as in `bench_scale.py`). Per job: the time from the apply request
to the first watch event showing `Provisioning`; then a node registers, leases the job's 8 rollouts and
reports them, and the time from sending the last result to the watch event showing `Succeeded`.
Targets (issue 13): p50 ≤ 100 ms and ≤ 200 ms.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from bench.bench_scale import P, Controller, HealthServer, _job, older_source

BASE_REV = os.environ.get("ROLLOUTD_BENCH_BASE", "f4c6f7a")  # `integrate` before the kopf handlers
HERE = Path(__file__).resolve().parent
NODES = P + "/nodes"


class PhaseWatch:
    """Every job's phases as the watch stream (server-sent events) shows them, with the arrival time."""

    def __init__(self, ctl: Controller) -> None:
        self.seen: dict[tuple[str, str], float] = {}
        self.cond = threading.Condition()
        self.client = httpx.Client(base_url=ctl.url, headers=dict(ctl.api.headers), timeout=None)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with contextlib.suppress(httpx.TransportError):
            with self.client.stream("GET", f"{P}/rolloutjobs", params={"watch": "true"},
                                    headers={"Accept": "text/event-stream"}) as s:
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        obj = json.loads(line[6:])
                        if "metadata" not in obj or "name" not in obj["metadata"]:  # a BOOKMARK
                            continue
                        key = (obj["metadata"]["name"], obj.get("status", {}).get("phase", "Pending"))
                        with self.cond:
                            self.seen.setdefault(key, time.perf_counter())
                            self.cond.notify_all()

    def wait(self, name: str, phase: str, timeout: float = 30.0) -> float:
        with self.cond:
            if not self.cond.wait_for(lambda: (name, phase) in self.seen, timeout):
                raise TimeoutError(f"{name}: no {phase} within {timeout}s (seen: {sorted(self.seen)[-5:]})")
            return self.seen[(name, phase)]

    def close(self) -> None:
        self.client.close()


def _node_call(node: httpx.Client, path: str, body: dict) -> dict:
    r = node.post(NODES + path, json=body)
    r.raise_for_status()
    return r.json()


def _trajectory(job: str, lease: dict) -> dict:
    from rolloutd.crds.trajectory import Trajectory

    t = Trajectory(job=job, prompt=lease["prompt"], sample=lease["sample"], task_id=str(lease["task"].get("id")),
                   finish_reason="stop", reward=1.0, node="sim", attempt=lease["attempt"]).wire()
    return {"attemptId": lease["attemptId"], "trajectory": t}


def measure(root: Path, src: Path | None, jobs: int) -> tuple[list[float], list[float]]:
    from rolloutd.crds.node import NODE_PROTOCOL

    root.mkdir(parents=True)
    source = root / "rows.jsonl"
    source.write_text('{"id":"r0"}\n')
    health, ctl = HealthServer(), Controller(root, src)
    watch = PhaseWatch(ctl)
    # the admin token acts as any node (per-job credentials and node tokens: bench_scale, tests/tenancy)
    node = httpx.Client(base_url=ctl.url, headers={"Authorization": f"Bearer {ctl.token}"}, timeout=60)
    provisioning, succeeded = [], []
    try:
        time.sleep(1.0)  # the watch is open and the operator has listed (its first pass is not measured)
        for i in range(jobs):
            name = f"lat-{i}"
            t0 = time.perf_counter()
            ctl.api.put(f"{P}/rolloutjobs/{name}", json=_job(name, source, 8, health.urls)).raise_for_status()
            provisioning.append(watch.wait(name, "Provisioning") - t0)
            node_id = _node_call(node, "/register", {"job": name, "protocol": NODE_PROTOCOL, "name": f"sim{i}",
                                                     "host": "sim", "pid": 0, "slot": 0})["nodeId"]
            leases: list[dict] = []
            while len(leases) < 8:
                leases += _node_call(node, f"/{node_id}/lease", {"maxItems": 8, "wait": 5.0}).get("leases", [])
            _node_call(node, f"/{node_id}/results", {"results": [_trajectory(name, l) for l in leases[:-1]]})
            t1 = time.perf_counter()
            _node_call(node, f"/{node_id}/results", {"results": [_trajectory(name, leases[-1])]})
            succeeded.append(watch.wait(name, "Succeeded") - t1)
    finally:
        node.close()
        watch.close()
        ctl.stop()
        health.close()
    return provisioning, succeeded


def _p50_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1000, 1)


def _p95_ms(xs: list[float]) -> float:
    return round(statistics.quantiles(xs, n=20)[-1] * 1000, 1)


def run(quick: bool = False) -> list[dict]:
    jobs = 8 if quick else 30
    tmp = Path(tempfile.mkdtemp(prefix="rolloutd-bench-operator-"))
    load = [os.getloadavg()[0]]
    try:
        with older_source(BASE_REV) as before:
            old_prov, old_done = measure(tmp / "before", before, jobs)
        load.append(os.getloadavg()[0])
        new_prov, new_done = measure(tmp / "after", None, jobs)
        load.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    for what, new, old, target in (("apply → Provisioning p50 (ms)", new_prov, old_prov, 100.0),
                                   ("last rollout → Succeeded p50 (ms)", new_done, old_done, 200.0)):
        ours, base = _p50_ms(new), _p50_ms(old)
        base_name = "the hand-written loop " if BASE_REV == "f4c6f7a" else ""
        rows.append({"benchmark": f"operator: {what}, {jobs} jobs (kopf handlers vs {base_name}@{BASE_REV})",
                     "ours": ours, "baseline": base, "ratio": round(ours / base, 2) if base else None,
                     "target": f"≤ {target:g} ms", "met": ours <= target})
    p95 = {"ours": (_p95_ms(new_prov), _p95_ms(new_done)), "base": (_p95_ms(old_prov), _p95_ms(old_done))}
    _write(rows, quick, load, p95)
    return rows


def _write(rows: list[dict], quick: bool, load: list[float], p95: dict) -> None:
    from bench.__main__ import render

    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    (HERE / "results" / "RESULTS-operator.md").write_text(
        f"# Reconcile latency: kopf handlers and the hand-written loop\n\n"
        f"`python -m bench operator{' --quick' if quick else ''}` (base {BASE_REV}) on {platform.node()} "
        f"({os.cpu_count()} cores), {stamp}. Load average (1 min) at start, between the variants, at the end: "
        f"{', '.join(f'{x:.1f}' for x in load)}.\n\n{render(rows)}\n"
        f"p95 (ms), Provisioning / Succeeded: kopf {p95['ours'][0]} / {p95['ours'][1]}, "
        f"@{BASE_REV} {p95['base'][0]} / {p95['base'][1]}.\n\n{__doc__}")


if __name__ == "__main__":
    for row in run(quick=bool(os.environ.get("QUICK"))):
        print(row)
