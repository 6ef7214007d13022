"""Node rows each replica reads per second with node shards on (ROLLOUTD_NODE_SHARDS=1): two real controller replicas
on a real PostgreSQL server, N nodes owned half by each (rows written by the bench; no daemon calls, so every read
counted is a replica's own background pass: the shards' refresh, the silent-node pass).

    python -m bench node_reads        [$ROLLOUTD_NODE_READS_NODES (1000), $ROLLOUTD_NODE_READS_BEFORE (main)]

The rows read are the server's own counts (`pg_stat_user_tables`: tuples read by sequential scans plus tuples
fetched through indexes, of `nodes` and `node_owners`) over a window, halved (two replicas); `before` runs the
same replicas of an older revision (`bench_scale.older_source`) on a server of its own, side by side.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench import scale_replicas, scale_stores
from bench.bench_pipeline import _cpu_seconds
from bench.bench_scale import Controller, older_source

TABLES = ("nodes", "node_owners")


def _stats(engine) -> dict[str, tuple[int, int, int, int]]:
    """table → (seq scans, tuples they read, index scans, tuples fetched through indexes)."""
    with engine.connect() as c:
        rows = c.exec_driver_sql("SELECT relname, seq_scan, seq_tup_read, coalesce(idx_scan, 0), "
                                 "coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables WHERE relname IN "
                                 "('nodes', 'node_owners')").all()
    return {r[0]: tuple(int(x) for x in r[1:]) for r in rows}


def _add_nodes(engine, n: int, urls: list[str]) -> None:
    """`n` nodes of one job, owned alternately by the replicas (as their first calls would have made them)."""
    with engine.begin() as c:
        stamped = c.exec_driver_sql("SELECT count(*) FROM information_schema.columns WHERE table_name = 'node_owners' "
                                    "AND column_name = 'stamp'").scalar()
        cur = c.connection.driver_connection.cursor()
        now = time.time()
        cur.executemany("INSERT INTO nodes (id, job, name, host, pid, registered, last_seen, state, features) "
                        "VALUES (%s, 'default/reads', %s, 'h', 0, %s, %s, 'active', '')",
                        [(f"n{i}", f"n{i}", now, now) for i in range(n)])
        cur.executemany("INSERT INTO node_owners (node_id, owner, moves" + (", stamp" if stamped else "") + ") VALUES "
                        "(%s, %s, 1" + (", pg_current_xact_id()::text::bigint" if stamped else "") + ")",
                        [(f"n{i}", urls[i % len(urls)]) for i in range(n)])


def point(variant: str, src: Path | None, nodes: int, window: float) -> dict:
    from sqlalchemy import create_engine

    from rolloutd.controller import dialects

    server = scale_stores.start_server()
    root = Path(tempfile.mkdtemp(prefix="rolloutd-node-reads-"))
    ctls: list = []
    engine = None
    try:
        url = server.create_database()
        ctls = scale_replicas.start(Controller, root, src, url, 2)
        engine = create_engine(dialects.engine_url(url))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the follower's work core made the node tables, its shards the owners'
            with engine.connect() as c:
                have = {r[0] for r in c.exec_driver_sql("SELECT relname FROM pg_stat_user_tables")}
                members = c.exec_driver_sql("SELECT count(*) FROM replica_members").scalar() \
                    if "replica_members" in have else 0
            if set(TABLES) <= have and members == 2:
                break
            time.sleep(0.5)
        _add_nodes(engine, nodes, [c.url for c in ctls])
        time.sleep(5.0)  # both refreshed: their nodes loaded (silent ones retire 60 s after that: the window ends first)
        before, cpu0, t0 = _stats(engine), [_cpu_seconds(c.proc.pid) for c in ctls], time.monotonic()
        time.sleep(window)
        after, cpu1, dt = _stats(engine), [_cpu_seconds(c.proc.pid) for c in ctls], time.monotonic() - t0
        with engine.connect() as c:
            live = c.exec_driver_sql("SELECT count(*) FROM nodes WHERE state != 'gone'").scalar()
        per = {t: [(a - b) / dt / 2 for a, b in zip(after[t], before[t])] for t in TABLES}
        read = {t: per[t][1] + per[t][3] for t in TABLES}
        return {"variant": variant, "nodes": nodes, "window_s": round(dt, 1), "live_at_end": live,
                "rows_per_s_per_replica": round(sum(read.values()), 1),
                **{f"{t}_rows_per_s": round(read[t], 1) for t in TABLES},
                **{f"{t}_seq_scans_per_s": round(per[t][0], 2) for t in TABLES},
                "replica_cpu_pct": [round(100 * (b - a) / dt, 1) for a, b in zip(cpu0, cpu1)]}
    finally:
        if engine is not None:
            engine.dispose()
        for c in ctls:
            c.stop()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def run(quick: bool = False) -> list[dict]:
    nodes = int(os.environ.get("ROLLOUTD_NODE_READS_NODES", "1000"))
    window = 15.0 if quick else 30.0
    rev = os.environ.get("ROLLOUTD_NODE_READS_BEFORE", "main")
    points = []
    with contextlib.ExitStack() as stack:
        variants = [("after", None)]
        if rev:
            variants.insert(0, (f"before ({rev})", stack.enter_context(older_source(rev))))
        for variant, src in variants:
            p = point(variant, src, nodes, window)
            print(p, file=sys.stderr, flush=True)
            points.append(p)
    base = points[0]["rows_per_s_per_replica"] if len(points) > 1 else None
    ours = points[-1]["rows_per_s_per_replica"]
    return [{"benchmark": f"node rows read per second per replica, 2 replicas, {nodes} nodes (no calls)",
             "ours": f"{ours:g}", "baseline": f"{base:g}" if base is not None else "-",
             "ratio": (base / ours if base and ours else None), "target": "reads only what changed", "met": None}]
