"""A dataset's expansion into queued items (`Expansions.expand`: 20 000 prompts × 8 samples), its rows written by
`dialects.insert_rows` (PostgreSQL: one INSERT over an array per column), by the driver's `executemany` of the same
INSERT, and by SQLAlchemy's bulk insert of the ORM's tables (the code before 2026-12-02), alternated on each store.

`python -m bench expansion` (`$ROLLOUTD_EXPANSION_STORES`: sqlite,postgresql): the controller process's CPU and the
wall time of the whole expansion, run in worker threads beside the event loop in a controller; the rows checked
equal. Results: `bench/results/RESULTS-scale.md`.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from unittest import mock

from sqlalchemy import insert, text
from sqlmodel import Session

from rolloutd.controller import dialects
from rolloutd.controller.store import Store
from rolloutd.controller.work import expansion
from rolloutd.controller.work.core import build_work
from rolloutd.controller.work.tables import ExpansionRow, ItemRow, TaskRow
from rolloutd.crds.rolloutjob import RolloutJob

PROMPTS, SAMPLES = 20_000, 8


def executemany(db, table, columns, rows) -> None:
    """The driver's per-row path for the same INSERT (what the ORM's bulk insert ran before, less the ORM)."""
    sql = f"INSERT INTO {table.name} ({', '.join(columns)}) VALUES {dialects.in_list(len(columns))}"
    db.executemany(sql, list(rows))


def orm_step(self, job, row):
    """`Expansions._step` as it was: the rows through SQLAlchemy's bulk insert of the ORM's tables."""
    key, n = job.metadata.key, job.spec.samples_per_prompt
    rows = self._data[key][1]
    first = row.prompts - row.pending
    last = min(row.prompts, first + max(1, expansion.CHUNK // n))
    now = self.clock()
    with Session(self.engine, expire_on_commit=False) as s:
        s.exec(insert(TaskRow), params=[{"job": key, "prompt": p, "data": json.dumps(rows[p])}
                                        for p in range(first, last)])
        s.exec(insert(ItemRow), params=[{"job": key, "prompt": p, "sample": k, "queued_at": now}
                                        for p in range(first, last) for k in range(n)])
        fresh = s.get(ExpansionRow, key)
        fresh.pending = row.prompts - last
        s.add(fresh)
        s.commit()
    self._rows[key] = fresh
    return fresh


def one(location: str, source: Path, write) -> dict:
    store = Store(location)
    store.apply(RolloutJob.model_validate({
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": "expand"},
        "spec": {"tasks": {"kind": "math", "source": str(source)}, "samplesPerPrompt": SAMPLES,
                 "agent": {"kind": "oracle"}, "executor": {"kind": "local"}}}))
    work = build_work(store)
    patch = (mock.patch.object(expansion.Expansions, "_step", orm_step) if write == "orm"
             else mock.patch.object(expansion, "insert_rows", write))
    with patch:
        cpu, wall = time.process_time(), time.perf_counter()
        row = work.expansions.expand(store.get("expand"))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    with store.engine.begin() as c:
        got = tuple(c.execute(text("SELECT count(*), count(DISTINCT prompt), min(state), max(state), sum(attempt), "
                                   "count(stage), min(last_error) FROM items")).fetchone())
    store.engine.dispose()
    assert row.total == PROMPTS * SAMPLES and not row.pending and not row.error, row
    assert got == (PROMPTS * SAMPLES, PROMPTS, "queued", "queued", 0, 0, ""), got
    return {"cpu_s": cpu, "wall_s": wall}


def run(quick: bool = False) -> list[dict]:
    from bench import scale_stores

    stores = os.environ.get("ROLLOUTD_EXPANSION_STORES", "sqlite,postgresql").split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="rolloutd-bench-expansion-") as tmp:
        source = Path(tmp) / "tasks.jsonl"
        source.write_text("".join(json.dumps({"id": i, "question": "?", "answer": "1"}) + "\n" for i in range(PROMPTS)))
        for store in stores:
            server = scale_stores.start_server() if store == "postgresql" else None
            got: dict[str, list[dict]] = {"orm": [], "executemany": [], "insert_rows": []}
            try:
                for r in range(1 if quick else 2):
                    for name, write in (("orm", "orm"), ("executemany", executemany),
                                        ("insert_rows", dialects.insert_rows)):
                        where = (server.create_database(f"e{r}{name[0]}") if server
                                 else str(Path(tmp) / f"{r}{name}.db"))
                        got[name].append(one(where, source, write))
                        print(f"   {store} {name}: {json.dumps(got[name][-1])}", flush=True)
            finally:
                if server:
                    server.stop()
            for key, what in (("cpu_s", "controller CPU"), ("wall_s", "wall")):
                new = min(g[key] for g in got["insert_rows"])
                for base in ("orm", "executemany"):
                    old = min(g[key] for g in got[base])
                    rows.append({"benchmark": f"{store}: expanding {PROMPTS} prompts × {SAMPLES}, {what}",
                                 "ours": f"{new:.2f} s", "baseline": f"{old:.2f} s ({base})", "ratio": old / new,
                                 "target": "reported", "met": None})
    return rows
