"""Fail-over time of controller replicas: two `rolloutd controller` processes on one database (ROLLOUTD_REPLICAS),
the leader killed (SIGKILL) KILLS times; per kill, the seconds from the kill until the other replica holds the lease
row and until it answers a leader-only call (the node protocol's path, through the follower's forwarding: a 404
from the leader, a 503 while no one leads). The killed one is started again as a follower before the next kill.
Also the cost of forwarding: a leader-only call straight to the leader and through the follower, p50 / p99.

    python -m bench failover        (once on SQLite, the replicas sharing one data dir on this machine, once on a
                                     PostgreSQL server of its own: tests/support/sim/pgserver.py)

Target: a replica leads ≤ 10 s after the leader dies (controller/ha/leadership.py: lease 5 s + renew 1 s + start).
"""
from __future__ import annotations

import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_pipeline import REPO, _port, _wait_http

KILLS = 10
PROBE = "/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs/none/nodes/n-0/heartbeat"  # leader-only


def _start(data: Path, port: int, env: dict[str, str], log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "rolloutd.controller.main", "controller", "--data-dir", str(data), "--port",
            str(port), "--executors", "local", "--log-level", "warning"]
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _lease(db: Path | str) -> tuple[str, int, float, str]:
    if isinstance(db, str):  # a postgresql:// URL
        from sqlalchemy import create_engine

        from rolloutd.controller import dialects
        from rolloutd.controller.ha.leadership import current

        engine = create_engine(dialects.engine_url(db))
        try:
            return current(engine)
        finally:
            engine.dispose()
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as c:
        return c.execute("SELECT holder, epoch, expires, url FROM leader_lease WHERE id = 1").fetchone()


def _leader_url(db: Path | str) -> str:
    try:
        holder, _, expires, url = _lease(db)
    except Exception:  # noqa: BLE001 - no table yet
        return ""
    return url if holder and expires > time.time() else ""


def _wait(pred, timeout: float = 60.0, every: float = 0.02) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if pred():
            return time.monotonic() - start
        time.sleep(every)
    raise TimeoutError("condition not met")


def _answers(url: str, token: str) -> bool:
    try:
        return httpx.post(url + PROBE, json={}, timeout=2, headers={"Authorization": f"Bearer {token}"}
                          ).status_code != 503
    except httpx.HTTPError:
        return False


def _latency(url: str, token: str, n: int) -> tuple[float, float]:
    with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=10) as c:
        c.post(url + PROBE, json={})
        times = []
        for _ in range(n):
            t = time.perf_counter()
            c.post(url + PROBE, json={})
            times.append((time.perf_counter() - t) * 1000)
    times.sort()
    return statistics.median(times), times[int(0.99 * (len(times) - 1))]


def run(quick: bool = False) -> list[dict]:
    from support.sim.pgserver import PgServer, binaries

    rows = _run_store("sqlite", None, quick)
    bindir = binaries()
    if bindir is None:
        print("failover: PostgreSQL's binaries are missing: SQLite only", file=sys.stderr)
        return rows
    server = PgServer(bindir).start()
    try:
        return rows + _run_store("postgresql", server.create_database("failover"), quick)
    finally:
        server.stop()


def _run_store(kind: str, store: str | None, quick: bool) -> list[dict]:
    kills = 3 if quick else KILLS
    root = Path(tempfile.mkdtemp(prefix="rolloutd-failover-"))
    data = root / "data"
    db: Path | str = store or data / "rolloutd.db"
    ports = [_port(), _port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    env = {**os.environ, "ROLLOUTD_REPLICAS": ",".join(urls), **({"ROLLOUTD_STORE": store} if store else {})}
    procs: dict[str, subprocess.Popen] = {}
    lead, answer = [], []
    try:
        procs[urls[0]] = _start(data, ports[0], env, root / "r0.log")
        _wait(lambda: _leader_url(db) == urls[0], 120)
        procs[urls[1]] = _start(data, ports[1], env, root / "r1.log")
        _wait_http(urls[1] + "/healthz", 120)
        token = (data / "token").read_text().strip()
        follower = urls[1]
        direct = _latency(urls[0], token, 100 if quick else 400)
        forwarded = _latency(follower, token, 100 if quick else 400)
        for _ in range(kills):
            old = _leader_url(db)
            other = next(u for u in urls if u != old)
            os.killpg(procs[old].pid, signal.SIGKILL)
            procs[old].wait(10)
            t0 = time.monotonic()
            _wait(lambda: _leader_url(db) == other, 60)
            lead.append(time.monotonic() - t0)
            _wait(lambda: _answers(other, token), 60)
            answer.append(time.monotonic() - t0)
            procs[old] = _start(data, int(old.rsplit(":", 1)[1]), env, root / "restarted.log")
            _wait_http(old + "/healthz", 120)
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(20)
    rows = [
        {"benchmark": f"failover ({kind}): a replica leads after kill -9 (max of {len(lead)})",
         "ours": f"{max(lead):.2f} s (p50 {statistics.median(lead):.2f})", "baseline": "one controller: never",
         "ratio": None, "target": "≤ 10 s", "met": max(lead) <= 10.0},
        {"benchmark": f"failover ({kind}): the new leader answers node calls (max of {len(answer)})",
         "ours": f"{max(answer):.2f} s (p50 {statistics.median(answer):.2f})", "baseline": "-",
         "ratio": None, "target": "≤ 10 s", "met": max(answer) <= 10.0},
        {"benchmark": f"failover ({kind}): a leader-only call through a follower, p50 / p99",
         "ours": f"{forwarded[0]:.2f} / {forwarded[1]:.2f} ms", "baseline": f"{direct[0]:.2f} / {direct[1]:.2f} ms "
         "(to the leader)", "ratio": forwarded[0] / direct[0], "target": "-", "met": None},
    ]
    print(f"failover ({kind}) kills: lead {[round(x, 2) for x in lead]} answer {[round(x, 2) for x in answer]}",
          file=sys.stderr)
    return rows
