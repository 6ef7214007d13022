"""Durability: what syncing acknowledged writes costs, three ways side by side in one run (issue 37).

    python -m bench durability          (writes bench/results/RESULTS-durability.md; --quick: shorter windows)

The same real `rolloutd controller` (`bench_scale.Controller`, its data dir on this machine's disk) in three modes,
set by a `sitecustomize.py` the bench puts on the controller's path (no setting in the product):
- `normal`: SQLite WAL with synchronous=NORMAL and nothing else (main before #37's fix: a commit is written, synced
  only at the next checkpoint, so a 201 could be lost with the disk);
- `settle`: as shipped: NORMAL, and an fsync of the WAL shared by every caller waiting meanwhile before a client's
  write is answered and before a node is told its results are stored (`controller/store/durability.py`); beats and
  leases pay none;
- `full`: synchronous=FULL on every store connection: every commit syncs, the node protocol's beats included.
Two measures per mode: API creates/s (8 clients POSTing small `nodes: 0` jobs for a window: 201s/s, client p50/p99;
the modes interleaved, `REPEATS` rounds, the median round kept) and the node side (`bench_scale.point`: simulated
daemons with no-op rollouts: rollouts/s accepted, beat p50/p99 — the daemons' results ride on their beats, so a
beat that carries results waits for the sync —, controller CPU per rollout, lost/duplicated). Ratios are against
`normal`, from the same run.
"""
from __future__ import annotations

import os
import platform
import shutil
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from bench.bench_scale import P, Controller, _pct, point
from support.sim.noop import noop_job

HERE = Path(__file__).resolve().parent
MODES = ("normal", "settle", "full")
REPEATS = 3
ENV = "ROLLOUTD_BENCH_DURABILITY"
SITE = f'''
import os
_mode = os.environ.get("{ENV}")
if _mode in ("normal", "full"):
    from rolloutd.controller.store import durability

    async def _settled(self):
        return None
    durability.Durable.settle = _settled
if _mode == "full":
    from sqlalchemy import event
    from rolloutd.controller.store import db as store_db
    _made = store_db.StoreDB._sqlite_engine

    def _full(self, path):
        engine = _made(self, path)

        @event.listens_for(engine, "connect")
        def _sync_full(conn, _record):
            conn.execute("PRAGMA synchronous=FULL")
        return engine
    store_db.StoreDB._sqlite_engine = _full
'''


def creates(src: Path, seconds: float, clients: int = 8) -> dict:
    """API creates/s: `clients` threads POST small jobs (8 no-op items, no node) for `seconds`."""
    root = Path(tempfile.mkdtemp(prefix="rolloutd-bench-durability-"))  # /tmp: the ext4 disk here, no tmpfs
    source = root / "rows.jsonl"
    source.write_text("".join(f'{{"id":"r{i}"}}\n' for i in range(1)))
    ctl = Controller(root, src)
    lat: list[float] = []
    codes: dict[int, int] = {}
    stop = time.monotonic() + seconds
    try:
        def client(k: int) -> None:
            with httpx.Client(base_url=ctl.url, headers={"Authorization": f"Bearer {ctl.token}"}, timeout=60) as c:
                i = 0
                while time.monotonic() < stop:
                    t = time.perf_counter()
                    r = c.post(f"{P}/rolloutjobs", json=noop_job(f"c{k}-{i}", source, 8, []))
                    lat.append((time.perf_counter() - t) * 1e3)
                    codes[r.status_code] = codes.get(r.status_code, 0) + 1
                    i += 1
        threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        took = time.monotonic() - t0
        syncs = _sync_metrics(ctl.api.get("/metrics").text)
    finally:
        ctl.stop()
        shutil.rmtree(root, ignore_errors=True)
    return {"per_s": codes.get(201, 0) / took, "p50": _pct(lat, 0.5), "p99": _pct(lat, 0.99), "codes": codes,
            **syncs}


def _sync_metrics(text: str) -> dict:
    """The controller's sync counters (`rolloutd_store_sync*`): fsyncs, writes that waited, seconds in each."""
    got = {}
    for line in text.splitlines():
        for name in ("syncs", "synced_writes", "sync_seconds", "sync_wait_seconds"):
            if line.startswith(f"rolloutd_store_{name}_total "):
                got[name] = float(line.split()[1])
    return got


def run(quick: bool = False) -> list[dict]:
    site = Path(tempfile.mkdtemp(prefix="rolloutd-bench-site-"))
    (site / "sitecustomize.py").write_text(SITE)
    window, nodes = (8.0, 30) if quick else (15.0, 100)
    api: dict[str, dict] = {}
    node: dict[str, dict] = {}
    try:
        rounds: dict[str, list[dict]] = {m: [] for m in MODES}
        for _ in range(1 if quick else REPEATS):  # API first, the modes interleaved, then the node side in turn
            for mode in MODES:
                os.environ[ENV] = mode
                rounds[mode].append(creates(site, window))
                print(f"   {mode}: {rounds[mode][-1]['per_s']:.1f} creates/s, p99 {rounds[mode][-1]['p99']:.1f} ms",
                      flush=True)
        for mode in MODES:
            api[mode] = sorted(rounds[mode], key=lambda r: r["per_s"])[len(rounds[mode]) // 2]
            api[mode]["all"] = [round(r["per_s"], 1) for r in rounds[mode]]
        for mode in MODES:
            os.environ[ENV] = mode
            node[mode] = point(nodes, 1.0, window, src=site, variant=mode)
            p = node[mode]
            print(f"   {mode}: {p['rollouts_per_s']} rollouts/s, p99 {p['p99_ms']}, audit {p['audit']}", flush=True)
    finally:
        os.environ.pop(ENV, None)
        shutil.rmtree(site, ignore_errors=True)
    _write(api, node, nodes, window)
    base_api, base_node = api["normal"]["per_s"], node["normal"]["rollouts_per_s"]
    rows = []
    for mode in ("settle", "full"):
        rows.append({"benchmark": f"API creates/s, 8 clients, {mode} vs normal (`durability`)",
                     "ours": f"{api[mode]['per_s']:.1f}/s", "baseline": f"{base_api:.1f}/s",
                     "ratio": api[mode]["per_s"] / base_api if base_api else None, "target": "-", "met": None})
        n = node[mode]
        rows.append({"benchmark": f"{nodes} simulated nodes' rollouts/s, {mode} vs normal (`durability`)",
                     "ours": f"{n['rollouts_per_s']}/s, beat p99 {n['p99_ms']['heartbeat']} ms, lost "
                             f"{n['audit']['lost']}", "baseline": f"{base_node}/s",
                     "ratio": n["rollouts_per_s"] / base_node if base_node else None, "target": "0 lost",
                     "met": n["audit"]["lost"] == 0 and n["audit"]["duplicated"] == 0})
    return rows


def _write(api: dict, node: dict, nodes: int, window: float) -> None:
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [f"# Durability (issue 37)\n",
           f"`python -m bench durability` on {platform.node()} ({platform.machine()}, {os.cpu_count()} cores, "
           f"shared), {when}, load average {os.getloadavg()[0]:.1f}; data dir on the machine's ext4 disk. "
           f"Windows of {window:g} s, the three modes one after the other in one run; ratios against `normal`.\n",
           "| mode | API creates/s (8 clients; each round) | ratio | create p50 / p99 ms | rollouts/s "
           f"({nodes} sim. nodes) | ratio | beat (with results) p50 / p99 ms | ctl ms/rollout | lost/dup "
           "| API: fsyncs / writes synced, ms per fsync, ms waited per write |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        a, n = api[mode], node[mode]
        out.append(f"| {mode} | {a['per_s']:.1f} ({', '.join(map(str, a['all']))}) | "
                   f"{a['per_s'] / api['normal']['per_s']:.2f}× | "
                   f"{a['p50']:.1f} / {a['p99']:.1f} | {n['rollouts_per_s']} | "
                   f"{n['rollouts_per_s'] / max(node['normal']['rollouts_per_s'], 1e-9):.2f}× | "
                   f"{n['p50_ms']['heartbeat']} / {n['p99_ms']['heartbeat']} | "
                   f"{n['ctl_ms_per_rollout']} | {n['audit']['lost']}/{n['audit']['duplicated']} | "
                   + (f"{a['syncs']:.0f} / {a['synced_writes']:.0f}, {a['sync_seconds'] / a['syncs'] * 1e3:.1f}, "
                      f"{a['sync_wait_seconds'] / a['synced_writes'] * 1e3:.1f} |" if a.get("syncs") else "- |"))
    (HERE / "results" / "RESULTS-durability.md").write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    for row in run(quick="--quick" in os.sys.argv):
        print(row)
