"""Fair share: episodes/s per tenant on one shared backend, with unequal `quotas.priority` (issue 36); then
team-b's episodes/s on a real engine beside team-a's worst legal job (`bench/fairshare_worst.py`).

    python -m bench fairshare        (writes bench/results/RESULTS-fairshare.md; --quick: a shorter window)
    ROLLOUTD_FAIRSHARE_PARTS=worst python -m bench fairshare     (only the worst-job part; `tenants`: only the first)

One real `rolloutd controller` (`bench_scale.Controller`) whose backend admits CAP episodes at once
(`ROLLOUTD_MAX_EPISODES_PER_BACKEND`: the engine is the bottleneck, as a shared vLLM is), one `/health` stub as that
backend, and three tenants: each namespace has a TenantPolicy whose `quotas.priority` is PRIORITIES[i], and its
namespace token applies a job asking for that priority (the most its policy allows: what a tenant that wants all it
can get does). Each job gets simulated daemons (`teams.sim_nodes`: the real node protocol, rollouts that sleep)
offering far more episodes than the backend admits, so every tenant always has a node waiting. Reported per tenant
over the window (after a warm-up): rollouts accepted per second, its share of all of them, and the share its
priority entitles it to (p / Σp); the goal: each share follows its priority, none below half of it, none at zero.
"""
from __future__ import annotations

import contextlib
import json
import os
import platform
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from bench import fairshare_worst
from bench.bench_scale import P, Controller, HealthServer
from bench.teams import job, sim_nodes
from rolloutd.controller.access.auth import create_scoped_token

HERE = Path(__file__).resolve().parent
CAP = 48  # episodes the shared backend admits at once
PRIORITIES = {"team-a": 1, "team-b": 3, "team-c": 6}
NODES, SLOTS = 2, 64  # per tenant: 128 slots each, 384 in all against a cap of 48
TIME_FACTOR = 20.0  # rollouts of ~2 s (median 40 s / 20)
WORST_HEADING = "## team-b beside team-a's worst legal job"
NOTES_HEADING = "\n### Notes"  # hand-written below the generated worst-job part, kept when it is rewritten


def _policy(namespace: str, priority: int, root: Path, backend: str) -> dict:
    return {"apiVersion": "rolloutd.io/v1alpha1", "kind": "TenantPolicy", "metadata": {"name": namespace},
            "spec": {"dataRoots": [str(root)], "backends": [backend],
                     "quotas": {"jobs": 4, "nodes": 2 * NODES, "priority": priority, "sandboxesPerNode": 4 * SLOTS}}}


def measure(window: float, warmup: float = 10.0) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-fairshare-") as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        root.chmod(0o755)  # a tenant's data must be readable by any user (the policy's check)
        source = root / "rows.jsonl"
        rows = 4000
        source.write_text("".join(f'{{"id":"r{i}"}}\n' for i in range(rows)))
        source.chmod(0o644)
        health = HealthServer()
        stack.callback(health.close)
        ctl = Controller(root, env={"ROLLOUTD_MAX_EPISODES_PER_BACKEND": str(CAP)})
        stack.callback(ctl.stop)
        backend = health.urls[0]
        for ns, prio in PRIORITIES.items():
            ctl.api.put(f"{P}/tenantpolicies/{ns}", json=_policy(ns, prio, root, backend)).raise_for_status()
            token = create_scoped_token(root / "data" / "tokens", f"tok-{ns}", read_only=False, namespaces=[ns])
            doc = job("fair", source, rows, 8, [backend])
            doc["spec"]["priority"] = prio
            doc["spec"]["pipeline"] = {"workersPerNode": {"init": SLOTS, "run": SLOTS, "eval": SLOTS}}
            with httpx.Client(base_url=ctl.url, headers={"Authorization": f"Bearer {token.token}"}, timeout=60) as t:
                r = t.post(f"{P}/namespaces/{ns}/rolloutjobs", json=doc)
                if r.status_code != 201:
                    raise RuntimeError(f"{ns}: the job was refused: {r.text}")
        for ns in PRIORITIES:  # every item queued before the daemons start
            deadline = time.monotonic() + 120
            while ((status := ctl.api.get(f"{P}/namespaces/{ns}/rolloutjobs/fair").json().get("status") or {})
                   .get("counts") or {}).get("total") != rows * 8:
                if time.monotonic() > deadline or status.get("phase") == "Failed":
                    raise RuntimeError(f"{ns}/fair not expanded: {status}")
                time.sleep(0.2)
        start_at = time.time() + 3
        stop_at = start_at + warmup + window
        procs = {ns: sim_nodes(ctl, ns, "fair", NODES, SLOTS, TIME_FACTOR, start_at, stop_at, root / f"{ns}.out.json",
                               seed=i) for i, ns in enumerate(PRIORITIES)}
        for p in procs.values():
            stack.callback(lambda p=p: p.poll() is None and (p.kill(), p.wait(5)))
        load0 = os.getloadavg()[0]
        for p in procs.values():
            p.wait(window + warmup + 240)
        w0, w1 = start_at + warmup, start_at + warmup + window
        out = {"window_s": window, "load": [round(load0, 1), round(os.getloadavg()[0], 1)], "tenants": {}}
        for ns, prio in PRIORITIES.items():
            res = json.loads((root / f"{ns}.out.json").read_text())
            done = sum(1 for t in res["accepted_at"] if w0 <= t < w1)
            out["tenants"][ns] = {"priority": prio, "rollouts": done, "per_s": done / window,
                                  "errors": res["errors"], "failed_loops": res["n_failed_loops"]}
        return out


def run(quick: bool = False) -> list[dict]:
    parts = os.environ.get("ROLLOUTD_FAIRSHARE_PARTS", "tenants,worst").split(",")
    out = HERE / "results" / "RESULTS-fairshare.md"
    old = out.read_text() if out.exists() else ""
    cut = old.find(WORST_HEADING)
    tenants_text, worst_text = (old[:cut], old[cut:]) if cut >= 0 else (old, "")
    results: list[dict] = []
    if "tenants" in parts:
        text, rows = _tenants(quick)
        results += rows
        tenants_text = text or tenants_text
    if "worst" in parts:
        notes = worst_text[worst_text.find(NOTES_HEADING):] if NOTES_HEADING in worst_text else ""
        m = fairshare_worst.measure(60.0 if quick else 120.0)
        table, rows = fairshare_worst.rows(m)
        results += rows
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        worst_text = (f"{WORST_HEADING}\n\n`python -m bench fairshare` on {platform.node()} ({platform.machine()}, "
                      f"{os.cpu_count()} cores, shared with other jobs, load {m['load'][0]}→{m['load'][1]}), {stamp}; "
                      f"windows of {m['window_s']:.0f} s after a 15 s warm-up; the engine started in "
                      f"{m['engine_start_s']:.0f} s.\n\n{table}\n{fairshare_worst.__doc__}{notes}")
    if not quick:
        out.write_text(tenants_text.rstrip("\n") + "\n\n" + worst_text if worst_text else tenants_text)
    return results


def _tenants(quick: bool) -> tuple[str, list[dict]]:
    window = 20.0 if quick else 60.0
    m = measure(window)
    total = sum(t["rollouts"] for t in m["tenants"].values()) or 1
    weights = sum(PRIORITIES.values())
    rows, results = [], []
    for ns, t in m["tenants"].items():
        share, fair = t["rollouts"] / total, t["priority"] / weights
        rows.append(f"| {ns} | {t['priority']} | {t['rollouts']} | {t['per_s']:.1f} | {share:.1%} | {fair:.1%} | "
                    f"{share / fair:.2f} |\n")
        results.append({"benchmark": f"fairshare: {ns} (priority {t['priority']}) share of a shared backend",
                        "ours": f"{share:.1%}", "baseline": f"{fair:.1%} by priority", "ratio": share / fair,
                        "target": "≥ 0.5 of its priority share, > 0", "met": t["rollouts"] > 0 and share >= fair / 2})
    table = ("| tenant | quotas.priority (= spec.priority) | rollouts in window | per s | share | share by priority "
             "| share / due |\n|---|---|---|---|---|---|---|\n" + "".join(rows))
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    errors = {ns: t["errors"] for ns, t in m["tenants"].items() if t["errors"] or t["failed_loops"]}
    text = (f"# Fair share on a shared backend (issue 36)\n\n`python -m bench fairshare` on {platform.node()} "
            f"({platform.machine()}, {os.cpu_count()} cores, shared with other jobs, load {m['load'][0]}→{m['load'][1]}),"
            f" {stamp}. One backend admitting {CAP} episodes at once; three tenants, each with {NODES} simulated "
            f"daemons × {SLOTS} slots ({NODES * SLOTS} episodes offered each, {len(PRIORITIES) * NODES * SLOTS} in all), "
            f"rollouts of ~{40 / TIME_FACTOR:.0f} s; each tenant's job asks for its policy's largest priority. Window "
            f"{window:.0f} s after a 10 s warm-up.\n\n{table}\n"
            f"Goal: each tenant's share follows its priority (share / due near 1), none below half its due, none "
            f"starved. Client errors: {errors or 'none'}.\n")
    return ("" if quick else text), results


if __name__ == "__main__":
    print(run())
