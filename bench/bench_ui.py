"""The web UI at 100 000 rollouts: the job page's and the trajectory page's data calls, timed.

Seeds one job of N trajectories straight into the store's database (the rows `Feed.insert` writes, ~400 tokens,
three turns and a conversation each; rewards 0/1, 5 % agent and 2 % infra failures, five policy versions), then
calls the UI's JSON routes in-process through the real app (`api.create_app`, bearer token) and times them:
- job page: `/ui/api/jobs/{ns}/{name}` cold (the first view after a controller start reads every trajectory's
  timings once) and warm (p50 of 5; only rows newer than the last view are read), and the jobs list;
- the job page's trajectory list: first page, failure filter, task-id search, text search (server-side, 50/page);
- trajectory page: `/ui/api/jobs/{ns}/{name}/trajectories/{seq}` decoded with the tiny model's tokenizer
  (p50 of 20, tokenizer loaded before);
- what it costs the hot path: µs per stored trajectory with and without the UI's two indexes.
Targets (issue 27): job page ≤ 1 s, trajectory page ≤ 300 ms.

    python -m bench ui [--quick]      (writes bench/results/RESULTS-ui.md; --quick seeds 20 000)
"""
from __future__ import annotations

import json
import platform
import random
import sqlite3
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from typing import Iterator

from fastapi.testclient import TestClient
from sqlalchemy import create_engine

from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.controller.api import create_app
from rolloutd.controller.store import Store
from rolloutd.controller.work.feed import Feed
from rolloutd.controller.work import tables
from rolloutd.controller.root import assemble
from rolloutd.crds.rolloutjob import RolloutJob

HERE = Path(__file__).resolve().parent
JOB = "big"
SAMPLES = 8


def _trajectory(rng: random.Random, prompt: int, sample: int) -> dict:
    plen, turns, ids, mask, lps, turn_docs = 100, 3, [], [], [], []
    ids += [rng.randrange(1000) for _ in range(plen)]
    mask += [0] * plen
    lps += [None] * plen
    for _ in range(turns):
        g, o = rng.randrange(60, 120), rng.randrange(10, 40)
        start = len(ids)
        ids += [rng.randrange(1000) for _ in range(g + o)]
        mask += [1] * g + [0] * o
        lps += [round(-rng.expovariate(4), 4) for _ in range(g)] + [None] * o
        turn_docs.append({"generatedStart": start, "generatedEnd": start + g, "observationStart": start + g,
                          "observationEnd": start + g + o, "finishReason": "stop", "toolCalls": []})
    kind = rng.choices(["none", "agent", "infra"], [93, 5, 2])[0]
    reward = None if kind == "infra" else float(rng.random() < 0.4)
    messages = [{"role": "user", "content": f"Problem {prompt}: " + "lorem ipsum " * 20}]
    messages += [{"role": r, "content": f"{r} text {rng.random()} " * 8} for r in ("assistant", "tool") * turns]
    return {"job": JOB, "prompt": prompt, "sample": sample, "taskId": f"task-{prompt}", "tokenIds": ids,
            "promptLength": plen, "lossMask": mask, "logprobs": lps, "turns": turn_docs, "messages": messages,
            "reward": reward, "rewardDetails": {"answer": "42"},
            "failure": {"kind": kind, "reason": {"none": "", "agent": "no answer submitted", "infra": "sandbox died"}[kind]},
            "finishReason": "stop", "policyVersion": prompt * 5 // 100_000, "attempt": 1,
            "timings": {"queue": rng.lognormvariate(-2, 1), "init": rng.lognormvariate(-1, 0.5),
                        "run": rng.lognormvariate(2, 0.7), "eval": rng.lognormvariate(0, 0.5)}}


def _rows(n: int, rng: random.Random, first_item: int = 1) -> Iterator[dict]:
    for i in range(n):
        prompt, sample = divmod(i, SAMPLES)
        t = _trajectory(rng, prompt, sample)
        yield {"job": JOB, "item": first_item + i, "prompt": prompt, "sample": sample, "reward": t["reward"],
               "failure": t["failure"]["kind"], "data": json.dumps(t, separators=(",", ":")), "group_id": None,
               "task_id": t["taskId"], "policy": json.dumps(t["policyVersion"]), "reason": t["failure"]["reason"],
               "t_end": 1.7e9 + (first_item + i) * 0.01, **{f"t_{k}": v for k, v in t["timings"].items()},
               "generated": sum(x["generatedEnd"] - x["generatedStart"] for x in t["turns"]), "turns": len(t["turns"]),
               "tool_errors": None, "truncated": 0}


def insert_cost(n: int = 20_000) -> dict[str, float]:
    """µs per stored trajectory (batches of 64, one commit each, WAL) with and without the UI's two indexes."""
    rows = list(_rows(n, random.Random(1)))
    out = {}
    for variant in ("without", "with", "without", "with"):
        db = Path(tempfile.mkdtemp(prefix="rolloutd-bench-ui-insert-")) / "db.sqlite"
        tables.create(create_engine(f"sqlite:///{db}"))
        con = sqlite3.connect(db)
        con.execute("PRAGMA journal_mode=WAL")
        con.execute("PRAGMA synchronous=NORMAL")
        if variant == "without":
            con.execute("DROP INDEX ix_trajectories_facts")
            con.execute("DROP INDEX ix_trajectories_job_prompt")
        t0 = time.perf_counter()
        for k in range(0, n, 64):
            Feed.insert(con, rows[k:k + 64])
            con.commit()
        out[variant] = min(out.get(variant, 1e9), (time.perf_counter() - t0) / n * 1e6)
        con.close()
    return out


def seed(db: Path, n: int) -> float:
    """N trajectories of one job, inserted as the feed inserts them; the seconds it took."""
    t0 = time.perf_counter()
    rows = _rows(n, random.Random(7))
    con = sqlite3.connect(db)
    batch = []
    for row in rows:
        batch.append(row)
        if len(batch) == 5000:
            Feed.insert(con, batch)
            con.commit()
            batch = []
    Feed.insert(con, batch)
    con.commit()
    con.close()
    return time.perf_counter() - t0


LATER = 20_000  # rows stored between two views of the job page (15 s of 1000 nodes at ~1350/s)


def _time(client: TestClient, url: str, n: int = 1) -> tuple[float, int]:
    times, size = [], 0
    for _ in range(n):
        t0 = time.perf_counter()
        r = client.get(url)
        times.append(time.perf_counter() - t0)
        assert r.status_code == 200, (url, r.status_code, r.text[:300])
        size = len(r.content)
    return statistics.median(times), size


def run(quick: bool = False) -> list[dict]:
    n = 20_000 if quick else 100_000
    tmp = Path(tempfile.mkdtemp(prefix="rolloutd-bench-ui-"))
    (tmp / "data.jsonl").write_text(json.dumps({"id": 0, "question": "q", "answer": "a"}) + "\n")
    store = Store(tmp / "db.sqlite")
    store.apply(RolloutJob.model_validate({
        "apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": JOB},
        "spec": {"tasks": {"kind": "math", "source": str(tmp / "data.jsonl")}, "samplesPerPrompt": SAMPLES,
                 "agent": {"kind": "oracle"}, "llm": {"tokenizer": str(model_dir("tiny"))},
                 "executor": {"kind": "local", "nodes": 0}}}))
    seeded = seed(tmp / "db.sqlite", n)
    db_mb = (tmp / "db.sqlite").stat().st_size / 1e6
    root = assemble(store, "admin", work={})
    app = create_app(root)
    base = f"/ui/api/jobs/default/{JOB}"
    with TestClient(app, headers={"Authorization": "Bearer admin"}) as client:
        # seq of a trajectory in the middle of the job
        mid = client.get(f"{base}/trajectories", params={"after": n // 2, "limit": 1}).json()["items"][0]["seq"]
        client.get(f"{base}/trajectories/{mid}")  # the tokenizer loads once per path (not counted below)
        timings = {
            "job page, cold (first view: every trajectory read once)": _time(client, base),
            "job page, warm (p50 of 5)": _time(client, base, 5),
            "job curves, cold (reward, pass rate, lengths; per version and over time)": _time(client, f"{base}/curves"),
            "jobs list": _time(client, "/ui/api/jobs", 5),
            "trajectory list, first page": _time(client, f"{base}/trajectories", 5),
            "trajectory list, failure=infra": _time(client, f"{base}/trajectories?failure=infra", 5),
            "trajectory list, task id (last task)": _time(client, f"{base}/trajectories?task=task-{(n - 1) // SAMPLES}", 3),
            "trajectory list, text search (absent: whole job scanned)": _time(client, f"{base}/trajectories?q=zz-absent", 3),
            "trajectory page (p50 of 20)": _time(client, f"{base}/trajectories/{mid}", 20),
        }
        # what a live page reads each second: the rows stored since its last view (a later read, by seq)
        more = LATER // 4 if quick else LATER
        con = sqlite3.connect(tmp / "db.sqlite")
        Feed.insert(con, list(_rows(more, random.Random(8), first_item=n + 1)))
        con.commit()
        con.close()
        timings[f"job page after {more} new trajectories (a live page's later read)"] = _time(client, base)
    cost = insert_cost(5_000 if quick else 20_000)
    targets = {"job page, cold": 1.0, "job page, warm": 1.0, "trajectory page": 0.3}
    rows = []
    for name, (secs, size) in timings.items():
        target = next((t for k, t in targets.items() if name.startswith(k)), None)
        rows.append({"benchmark": f"ui {name}", "ours": f"{secs * 1000:.0f} ms ({size / 1000:.0f} kB)",
                     "baseline": "-", "ratio": None, "target": f"≤ {target * 1000:.0f} ms" if target else "-",
                     "met": None if target is None else secs <= target})
    kept = (HERE / "results" / "RESULTS-ui.md").read_text().partition("\n## With dashboards open")  # bench_ui_live's section
    (HERE / "results" / "RESULTS-ui.md").write_text(
        f"# UI at {n} rollouts\n\n{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{platform.processor() or platform.machine()}; seeded {n} trajectories in {seeded:.1f} s "
        f"(database {db_mb:.0f} MB)\n\n| call | time (response size) | target | met |\n|---|---|---|---|\n"
        + "".join(f"| {r['benchmark'][3:]} | {r['ours']} | {r['target']} | "
                  f"{ {True: 'yes', False: '**no**', None: '-'}[r['met']]} |\n" for r in rows)
        + f"\nWhat the UI costs the store: {cost['with']:.0f} µs per stored trajectory with its two indexes "
          f"(`ix_trajectories_facts`, `ix_trajectories_job_prompt`), {cost['without']:.0f} µs without them "
          "(batches of 64, WAL; best of two each).\n" + "".join(kept[1:]))
    rows.append({"benchmark": "ui store cost per trajectory (with / without the UI's indexes)",
                 "ours": f"{cost['with']:.0f} µs / {cost['without']:.0f} µs", "baseline": "-", "ratio": None,
                 "target": "-", "met": None})
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
