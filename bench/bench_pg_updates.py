"""A lease's grant on PostgreSQL: 64 items updated by psycopg's `executemany` (a pipelined statement per row, as the
hot path did) and by `dialects.update_by_id` (one statement over an array per column), alternated on one server.

`python -m bench pg_updates`: the controller process's CPU and the wall time per 64-row grant, each in a transaction
of its own, as a lease outside a group commit runs; the rows checked equal after both. Results: the benchmarks page
("Constants") and `bench/results/RESULTS-scale.md`.
"""
from __future__ import annotations

import time

import psycopg

from rolloutd.controller.dialects import PgRaw, update_by_id
from rolloutd.controller.store import Store
from rolloutd.controller.work import hot_sql
from rolloutd.controller.work.core import build_work

ROWS, GRANTS = 64, 200
GRANT_SQL = ("UPDATE items SET state = ?, stage = ?, node_id = ?, attempt = ?, attempt_id = ?, deadline = ?, "
             "backend = ?, holds_backend = ? WHERE id = ?")


def grants(ids: list[int], k: int) -> list[tuple]:
    return [("leased", "leased", f"n{k}", 1, f"{i}.1.{k:06x}", 100.5 + k, None if i % 2 else "b0", i % 2 == 0, i)
            for i in ids]


def timed(conn: psycopg.Connection, write, batches: list[list[tuple]]) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    for rows in batches:
        with conn.transaction():
            write(PgRaw(conn), rows)
    return ((time.process_time() - cpu) / len(batches) * 1e3, (time.perf_counter() - wall) / len(batches) * 1e3)


def run(quick: bool = False) -> list[dict]:
    from bench import scale_stores

    server = scale_stores.start_server()
    try:
        url = server.create_database("updates")
        build_work(Store(url))  # the schema, as the controller makes it
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
            n = ROWS * GRANTS * 2
            conn.execute("INSERT INTO items (job, prompt, sample, state, attempt, holds_backend, queued_at, "
                         "last_error) SELECT 'j', g, 0, 'queued', 0, false, 0, '' FROM generate_series(1, %s) g", (n,))
            ids = [r[0] for r in conn.execute("SELECT id FROM items ORDER BY id")]
            chunks = [ids[k * ROWS:(k + 1) * ROWS] for k in range(len(ids) // ROWS)]
            many = lambda db, rows: db.executemany(GRANT_SQL, rows)  # noqa: E731
            one = lambda db, rows: update_by_id(db, hot_sql.ITEMS, hot_sql._GRANTED, rows)  # noqa: E731
            got: dict[str, list[tuple[float, float]]] = {"executemany": [], "update_by_id": []}
            rounds = 2 if quick else 4
            per = GRANTS // rounds
            for r in range(rounds):  # alternated: a drift of the box falls on both
                for name, write, base in (("executemany", many, 0), ("update_by_id", one, GRANTS)):
                    part = [grants(chunks[base + k], base + k) for k in range(r * per, (r + 1) * per)]
                    got[name].append(timed(conn, write, part))
            left = conn.execute("SELECT count(*) FROM items WHERE state <> 'leased'").fetchone()[0]
            assert left == 0, f"{left} rows not granted"
            same = conn.execute("SELECT count(*) FROM items WHERE attempt_id <> id || '.1.' || "
                                "lpad(to_hex((id - 1) / %s), 6, '0') OR (backend IS NULL) <> (id %% 2 = 1)",
                                (ROWS,)).fetchone()[0]
            assert same == 0, f"{same} rows written wrong"
    finally:
        server.stop()
    cpu = {k: sorted(c for c, _ in v)[len(v) // 2] for k, v in got.items()}
    wall = {k: sorted(w for _, w in v)[len(v) // 2] for k, v in got.items()}
    print(f"   per {ROWS}-row grant, median of {rounds} rounds: cpu {cpu}, wall {wall}", flush=True)
    return [{"benchmark": f"PostgreSQL: a {ROWS}-item grant, {what}", "ours": f"{got['update_by_id']:.2f} ms",
             "baseline": f"{got['executemany']:.2f} ms (executemany)",
             "ratio": got["executemany"] / got["update_by_id"], "target": "reported", "met": None}
            for what, got in (("controller CPU", cpu), ("wall", wall))]
