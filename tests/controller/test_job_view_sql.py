"""The web UI's job views (`controller/ui/jobview.py`: curves, pass rates, zero-variance groups, the trajectories
page) read the same numbers from either store: SQLite's JSON functions and PostgreSQL's, each database's forms."""
from __future__ import annotations

import json

from rolloutd.controller.store import Store
from rolloutd.controller.ui import jobview
from rolloutd.controller.work import hot_sql, tables
from rolloutd.controller.work.feed import Feed


def row(item: int, prompt: int, reward: float, t_end: float) -> dict:
    data = {"tokenIds": [1, 2, 3], "metrics": {"generated_tokens": 2}, "turns": [{}, {}]}
    return {"job": "j", "item": item, "prompt": prompt, "sample": item % 2, "reward": reward, "failure": "none",
            "data": json.dumps(data), "group_id": None, "task_id": f"t{prompt}", "policy": "1", "reason": "",
            "t_queue": 0.5, "t_init": 1.0, "t_run": float(item), "t_eval": 0.5, "t_end": t_end}


def test_curves_and_the_trajectories_page_read_the_same_on_both_stores(store_location):
    store = Store(store_location)
    tables.create(store.engine)
    with hot_sql.transaction(store.engine) as tx:  # prompt 0: both passed (zero variance); prompt 1: one of two
        Feed.insert(tx.db, [row(1, 0, 1.0, 100.0), row(2, 0, 1.0, 160.0), row(3, 1, 0.0, 130.0), row(4, 1, 1.0, 190.0)])
    out = jobview.Curves(store.engine).get("j", "uid", samples=2)
    assert out["byPolicy"] == [{"policyVersion": 1, "n": 4, "rewardMean": 0.75, "passRate": 0.75}]
    assert [(p["bucket"], p["n"]) for p in out["overTime"]["points"]] == [(0, 1), (20, 1), (40, 1), (59, 1)]
    assert [(p["prompt"], p["taskId"], p["passed"], p["passRate"]) for p in out["prompts"]["items"]] == \
        [(1, "t1", 1, 0.5), (0, "t0", 2, 1.0)]
    assert out["zeroVariance"]["count"] == 1 and out["zeroVariance"]["completeGroups"] == 2
    assert out["zeroVariance"]["items"][0]["prompt"] == 0
    page = jobview.search(store.engine, "j", sort="-duration", limit=3, text="tokenIds")
    assert [t["seq"] for t in page["items"]] == [4, 3, 2] and page["next"] == 3
    assert {(t["tokens"], t["generatedTokens"], t["turns"]) for t in page["items"]} == {(3, 2, 2)}
