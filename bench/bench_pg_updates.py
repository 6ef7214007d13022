"""A lease's grant and a results call's trajectories on PostgreSQL: 64 items updated, and 64 trajectories inserted,
by psycopg's `executemany` (a pipelined statement per row, as the hot path did) and by one statement over an array
per column (`dialects.update_by_id`, `insert_rows` as `Feed.insert` calls it), alternated on one server.

`python -m bench pg_updates`: the controller process's CPU and the wall time per 64 rows, each in a transaction
of its own, as a call outside a group commit runs; the rows checked after both. Results: the benchmarks page
("Constants") and `bench/results/RESULTS-scale.md`.
"""
from __future__ import annotations

import time

import psycopg

from rolloutd.controller.dialects import PgRaw, update_by_id
from rolloutd.controller.store import Store, nul_text
from rolloutd.controller.work import hot_sql
from rolloutd.controller.work.core import build_work
from rolloutd.controller.work.feed import FEED_COLUMNS, Feed

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


def trajectories(k: int) -> list[dict]:
    """A results call's 64 rows (`Feed.deliver`'s), each with a ~2 KB document, as a short rollout's."""
    text = "x" * 1800
    return [{"job": "j", "item": k * ROWS + i, "prompt": k, "sample": i, "reward": 1.0 if i % 2 else 0.0,
             "failure": "none", "data": f'{{"item": {k * ROWS + i}, "turns": ["{text}"]}}', "group_id": None,
             "task_id": f"t{k}", "policy": "[3, 0]", "reason": "", "t_queue": 0.01, "t_init": 0.2, "t_run": 40.5,
             "t_eval": 0.1, "t_end": 1.8e9 + i, "generated": 512, "turns": 3, "tool_errors": 0, "truncated": 0}
            for i in range(ROWS)]


def feed_inserts(conn: psycopg.Connection, rounds: int) -> dict[str, list[tuple[float, float]]]:
    """`Feed.insert` (one statement) against the `executemany` it replaced, alternated; every row stored once."""
    sql = (f"INSERT INTO trajectories ({', '.join(FEED_COLUMNS)}) VALUES "
           f"({', '.join(':' + c for c in FEED_COLUMNS)})")
    many = lambda db, rows: db.executemany(sql, rows)  # noqa: E731
    got: dict[str, list[tuple[float, float]]] = {"executemany": [], "insert_rows": []}
    per, k = GRANTS // rounds, 0
    for _ in range(rounds):
        for name, write in (("executemany", many), ("insert_rows", Feed.insert)):
            got[name].append(timed(conn, write, [trajectories(k + j) for j in range(per)]))
            k += per
    stored = conn.execute("SELECT count(*), count(DISTINCT item) FROM trajectories").fetchone()
    assert stored == (k * ROWS, k * ROWS), stored
    return got


def medians(got: dict[str, list[tuple[float, float]]]) -> tuple[dict[str, float], dict[str, float]]:
    return ({k: sorted(c for c, _ in v)[len(v) // 2] for k, v in got.items()},
            {k: sorted(w for _, w in v)[len(v) // 2] for k, v in got.items()})


def run(quick: bool = False) -> list[dict]:
    from bench import scale_stores

    server = scale_stores.start_server()
    try:
        url = server.create_database("updates")
        build_work(Store(url))  # the schema, as the controller makes it
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
            nul_text.install(conn)  # as the controller's connections: its strings dumped by Python, not C
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
            fed = feed_inserts(conn, rounds)
    finally:
        server.stop()
    out = []
    for what, one, times in ((f"a {ROWS}-item grant", "update_by_id", got), (f"{ROWS} trajectories stored", "insert_rows",
                                                                            fed)):
        cpu, wall = medians(times)
        print(f"   {what}, median of {rounds} rounds: cpu {cpu}, wall {wall}", flush=True)
        out += [{"benchmark": f"PostgreSQL: {what}, {kind}", "ours": f"{m[one]:.2f} ms",
                 "baseline": f"{m['executemany']:.2f} ms (executemany)", "ratio": m["executemany"] / m[one],
                 "target": "reported", "met": None} for kind, m in (("controller CPU", cpu), ("wall", wall))]
    return out
