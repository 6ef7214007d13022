"""The web UI's job views (`controller/ui/jobview.py`: curves, pass rates, zero-variance groups, the trajectories
page) read the same numbers from either store: SQLite's JSON functions and PostgreSQL's, each database's forms; and
a database from before the length columns gains them, filled from the documents as the feed fills them."""
from __future__ import annotations

import json

from rolloutd.controller.dialects import raw
from rolloutd.controller.store import Store
from rolloutd.controller.ui import jobview
from rolloutd.controller.work import hot_sql, tables
from rolloutd.controller.work.feed import Feed, length_facts
from rolloutd.crds.trajectory import Trajectory


def row(item: int, prompt: int, reward: float, t_end: float) -> dict:
    data = {"tokenIds": [1, 2, 3], "metrics": {"generated_tokens": 2}, "turns": [{}, {}]}
    return {"job": "j", "item": item, "prompt": prompt, "sample": item % 2, "reward": reward, "failure": "none",
            "data": json.dumps(data), "group_id": None, "task_id": f"t{prompt}", "policy": "1", "reason": "",
            "t_queue": 0.5, "t_init": 1.0, "t_run": float(item), "t_eval": 0.5, "t_end": t_end,
            "generated": 2 * item, "turns": item, "tool_errors": item % 2 if item < 4 else None,
            "truncated": int(item == 4)}


def test_curves_and_the_trajectories_page_read_the_same_on_both_stores(store_location):
    store = Store(store_location)
    tables.create(store.engine)
    with hot_sql.transaction(store.engine) as tx:  # prompt 0: both passed (zero variance); prompt 1: one of two
        Feed.insert(tx.db, [row(1, 0, 1.0, 100.0), row(2, 0, 1.0, 160.0), row(3, 1, 0.0, 130.0), row(4, 1, 1.0, 190.0)])
    out = jobview.Curves(store.engine).get("j", "uid", samples=2)
    # generated 2, 4, 6, 8; turns 1–4; tool errors 1, 0, 1 (the fourth agent counts none); the fourth truncated
    assert out["byPolicy"] == [{"policyVersion": 1, "n": 4, "rewardMean": 0.75, "passRate": 0.75, "generatedMean": 5.0,
                                "turnsMean": 2.5, "toolErrorRate": 0.6667, "truncationRate": 0.25}]
    assert [(p["bucket"], p["n"]) for p in out["overTime"]["points"]] == [(0, 1), (20, 1), (40, 1), (59, 1)]
    assert [(p["generatedMean"], p["turnsMean"], p["toolErrorRate"], p["truncationRate"])
            for p in out["overTime"]["points"]] == [(2.0, 1.0, 1.0, 0.0), (6.0, 3.0, 1.0, 0.0), (4.0, 2.0, 0.0, 0.0),
                                                    (8.0, 4.0, None, 1.0)]
    assert json.loads(json.dumps(out)) == out  # plain numbers (PostgreSQL's avg of integers is a numeric)
    assert [(p["prompt"], p["taskId"], p["passed"], p["passRate"]) for p in out["prompts"]["items"]] == \
        [(1, "t1", 1, 0.5), (0, "t0", 2, 1.0)]
    assert out["zeroVariance"]["count"] == 1 and out["zeroVariance"]["completeGroups"] == 2
    assert out["zeroVariance"]["items"][0]["prompt"] == 0
    page = jobview.search(store.engine, "j", sort="-duration", limit=3, text="tokenIds")
    assert [t["seq"] for t in page["items"]] == [4, 3, 2] and page["next"] == 3
    assert [(t["tokens"], t["generatedTokens"], t["turns"]) for t in page["items"]] == [(3, 8, 4), (3, 6, 3), (3, 4, 2)]


DOCS = [  # the agent loop's metrics; none (the turns' own slices); a truncated rollout; a document without turns
    {"job": "j", "prompt": 0, "sample": 0, "metrics": {"generated_tokens": 7, "turns": 3, "tool_errors": 2},
     "turns": [{"generatedStart": 1, "generatedEnd": 2}], "finishReason": "stop"},
    {"job": "j", "prompt": 0, "sample": 1, "turns": [{"generatedStart": 2, "generatedEnd": 5},
                                                    {"generatedStart": 8, "generatedEnd": 12}]},
    {"job": "j", "prompt": 1, "sample": 0, "metrics": {"generated_tokens": 64, "turns": 1, "tool_errors": 0},
     "turns": [{"generatedStart": 0, "generatedEnd": 64}], "finishReason": "length"},
    {"job": "j", "prompt": 1, "sample": 1},
    # metrics that are no counts: a float (an integer's worth), a string, a boolean
    {"job": "j", "prompt": 2, "sample": 0, "metrics": {"generated_tokens": 9.0, "turns": "two", "tool_errors": True},
     "turns": [{"generatedStart": 0, "generatedEnd": 3}, {"generatedStart": 5, "generatedEnd": 6}]},
    # counts no column holds (a hostile node's): not counted, the fill not stopped (PostgreSQL's columns: 32-bit)
    {"job": "j", "prompt": 2, "sample": 1, "metrics": {"generated_tokens": 3e9, "turns": 10**19, "tool_errors": -2**40},
     "turns": [{"generatedStart": 0, "generatedEnd": 2**62}, {"generatedStart": -2**62, "generatedEnd": 2**62}]},
    {"job": "j", "prompt": 3, "sample": 0, "metrics": {"generated_tokens": 10**400, "turns": 2**31, "tool_errors": 1e300}},
]


def test_a_database_from_before_the_length_columns_gains_them_filled_from_the_documents(store_location):
    store = Store(store_location)
    tables.create(store.engine)
    with store.engine.begin() as c:  # the table as the release before these columns made it
        c.exec_driver_sql("DROP INDEX ix_trajectories_facts")
        c.exec_driver_sql("CREATE INDEX ix_trajectories_facts ON trajectories (job, failure, reward, policy, t_queue, "
                          "t_init, t_run, t_eval, t_end)")
        for col in tables.LENGTH_FACTS:
            c.exec_driver_sql(f"ALTER TABLE trajectories DROP COLUMN {col}")
    with hot_sql.transaction(store.engine) as tx:
        for i, d in enumerate(DOCS):
            tx.db.execute("INSERT INTO trajectories (job, item, prompt, sample, reward, failure, reason, data) "
                          "VALUES ('j', ?, ?, ?, 1.0, 'none', '', ?)", (i, d["prompt"], d["sample"], json.dumps(d)))
    tables.create(store.engine)
    with store.engine.connect() as c:
        got = [tuple(r) for r in raw(c).execute(
            "SELECT generated, turns, tool_errors, truncated FROM trajectories ORDER BY seq").fetchall()]
    assert got == [(7, 3, 2, 0), (7, 2, None, 0), (64, 1, 0, 1), (0, 0, None, 0), (9, 2, None, 0), (None, 2, None, 0),
                   (0, 0, None, 0)]
    assert [tuple(length_facts(Trajectory.model_validate(d)).values()) for d in DOCS] == got  # as the feed writes
    assert jobview.Curves(store.engine).get("j", "uid", samples=2)["byPolicy"][0]["truncationRate"] == 0.1429  # 1 of 7
