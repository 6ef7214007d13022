"""The columns the UI sums (`work/tables.FACTS`): written by the feed with each trajectory, and filled once for
the trajectories of a database from before them; the job page's sums read them, never the documents. Also the
decoded view of a harness's segments (real SQLite, the tiny model's real tokenizer)."""
from __future__ import annotations

import json
import sqlite3

from sqlalchemy import create_engine

from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.controller import decode
from rolloutd.controller.ui import jobview
from rolloutd.controller.work import stats, tables
from rolloutd.controller.work.feed import facts
from rolloutd.crds.trajectory import Trajectory

OLD = ("CREATE TABLE trajectories (seq INTEGER PRIMARY KEY, job VARCHAR NOT NULL, item INTEGER NOT NULL UNIQUE, "
       "prompt INTEGER NOT NULL, sample INTEGER NOT NULL, reward FLOAT, failure VARCHAR NOT NULL, data VARCHAR NOT NULL, "
       "group_id INTEGER)")


def doc(sample: int, reward, kind: str = "none", reason: str = "", version=3) -> dict:
    return {"job": "j", "prompt": 0, "sample": sample, "taskId": "t0", "reward": reward, "policyVersion": version,
            "failure": {"kind": kind, "reason": reason}, "timings": {"queue": 0.1, "init": 1.0, "run": 2.0 + sample,
                                                                    "eval": 0.5, "stamps": {"end": 1000.0 + sample}}}


def _upgraded(db, docs: list[dict]):
    """A database from before the facts holding `docs` as its trajectories, opened by today's code (which fills them)."""
    con = sqlite3.connect(db)
    con.execute(OLD)
    for i, d in enumerate(docs):
        con.execute("INSERT INTO trajectories (job, item, prompt, sample, reward, failure, data) VALUES (?,?,?,?,?,?,?)",
                    ("j", i, 0, d["sample"], d["reward"], d["failure"]["kind"], json.dumps(d)))
    con.commit()
    con.close()
    engine = create_engine(f"sqlite:///{db}")
    tables.create(engine)
    return engine


def test_an_older_database_gains_the_facts_and_the_sums_read_them(tmp_path):
    db = tmp_path / "old.db"
    engine = _upgraded(db, [doc(0, 1.0), doc(1, 0.0, "agent", "no answer"), doc(2, None, "infra", "sandbox died", "v2")])
    got = sqlite3.connect(db).execute("SELECT task_id, policy, reason, t_run, t_end, generated, turns, truncated "
                                      "FROM trajectories ORDER BY seq").fetchall()
    assert got == [("t0", "3", "", 2.0, 1000.0, 0, 0, 0), ("t0", "3", "no answer", 3.0, 1001.0, 0, 0, 0),
                   ("t0", '"v2"', "sandbox died", 4.0, 1002.0, 0, 0, 0)]
    summary = stats.JobStats(engine).summary("j", "uid")
    run = next(s for s in summary["stages"] if s["stage"] == "run")
    assert run["n"] == 2 and run["p50"] == 2.0 and run["p95"] == 3.0  # the infra failure has no stage times
    assert summary["rewardByPolicy"] == [{"policyVersion": 3, "n": 2, "mean": 0.5}]
    assert {f["kind"]: f["reasons"][0]["reason"] for f in summary["failures"]} == {"agent": "no answer",
                                                                                   "infra": "sandbox died"}
    assert jobview.search(engine, "j", task="t0", failure="agent")["items"][0]["reason"] == "no answer"
    assert summary["throughput"] == {"start": 1000, "bucketSeconds": 1, "counts": [1, 1, 1], "total": 3, "unplaced": 0}
    index = [r[2] for r in sqlite3.connect(db).execute("PRAGMA index_info(ix_trajectories_facts)")]
    assert index[-5:] == ["t_end", *tables.LENGTH_FACTS]  # the sums (throughput, lengths) read the covering index alone


def test_the_fill_leaves_seconds_no_sum_can_take_not_counted_as_the_feed_does(tmp_path):
    """A stored document's 1e308 s (a node may report it; JSON keeps it) is not copied into its column: a sum of two
    was infinite, which the job page's JSON cannot hold."""
    db = tmp_path / "old.db"
    big = doc(0, 1.0)
    big["timings"].update(run=1e308, eval=1e300, stamps={"end": 1e300})
    engine = _upgraded(db, [big, doc(1, 1.0)])
    got = sqlite3.connect(db).execute("SELECT t_queue, t_run, t_eval, t_end FROM trajectories ORDER BY seq").fetchall()
    assert got == [(0.1, None, None, None), (0.1, 3.0, 0.5, 1001.0)]
    assert [tuple(facts(Trajectory.model_validate(d))[c] for c in ("t_queue", "t_run", "t_eval", "t_end"))
            for d in (big, doc(1, 1.0))] == got  # as the feed writes them
    summary = stats.JobStats(engine).summary("j", "uid")
    json.dumps(summary, allow_nan=False)
    assert next(s for s in summary["stages"] if s["stage"] == "run")["n"] == 1


def test_throughput_keeps_bounded_buckets_whose_total_is_every_rollout(tmp_path):
    """A week of rollouts, a few at a time: at most THROUGHPUT_BUCKETS buckets, ENDS_KEPT keys, nothing lost."""
    engine = create_engine(f"sqlite:///{tmp_path / 'db'}")
    tables.create(engine)
    job_stats, week, n = stats.JobStats(engine), 7 * 86400, 20_000
    insert = ("INSERT INTO trajectories (job, item, prompt, sample, reward, failure, data, reason, t_end) "
              "VALUES ('j', ?, 0, 0, 1.0, 'none', '{}', '', ?)")
    for part in range(4):  # read as it grows: the resolution coarsens between views, and the sums stay exact
        with engine.begin() as c:
            rows = [(i, 1_700_000_000 + i * week / n) for i in range(part * n // 4, (part + 1) * n // 4)]
            c.connection.executemany(insert, rows)
        tp = job_stats.summary("j", "uid")["throughput"]
        assert sum(tp["counts"]) == tp["total"] == (part + 1) * n // 4
        assert len(tp["counts"]) <= stats.THROUGHPUT_BUCKETS
    assert len(job_stats._acc["j"].ends) <= stats.ENDS_KEPT
    assert tp["start"] <= 1_700_000_000 and tp["start"] + len(tp["counts"]) * tp["bucketSeconds"] >= 1_700_000_000 + week * (n - 1) / n


def test_the_feed_writes_the_same_facts_the_migration_fills():
    t = Trajectory.model_validate(doc(1, 0.0, "agent", "x" * 500))
    assert facts(t) == {"task_id": "t0", "policy": "3", "reason": "x" * tables.FACT_REASON, "t_queue": 0.1,
                        "t_init": 1.0, "t_run": 3.0, "t_eval": 0.5, "t_end": 1001.0, "generated": 0, "turns": 0,
                        "tool_errors": None, "truncated": 0}


def test_segments_decode_one_by_one_with_the_jobs_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir("tiny")), local_files_only=True)
    first, second = tok.encode("Hello there", add_special_tokens=False), tok.encode("General Kenobi", add_special_tokens=False)
    seg = lambda ids, p: {"tokenIds": ids, "promptLength": p, "lossMask": [0] * p + [1] * (len(ids) - p),  # noqa: E731
                          "logprobs": [None] * p + [-0.5] * (len(ids) - p),
                          "turns": [{"generatedStart": p, "generatedEnd": len(ids)}]}
    t = {"job": "j", "prompt": 0, "sample": 0, "segments": [seg(first + second, len(first)), seg(second + first, 0)]}
    view = decode.decode(t, str(model_dir("tiny")))
    assert view["tokenizerProblem"] == "" and len(view["sequences"]) == 2
    assert view["sequences"][0]["prompt"] == "Hello there"
    assert view["sequences"][0]["turns"][0]["assistant"].strip() == "General Kenobi"
    assert [k["mask"] for k in view["sequences"][1]["tokenView"]["tokens"]] == [1] * len(second + first)
    missing = decode.decode(t, "/nonexistent/tokenizer")
    assert missing["tokenizerProblem"] == "spec.llm.tokenizer '/nonexistent/tokenizer' could not be loaded on the controller's host"


def test_a_facts_index_from_before_the_end_time_or_the_lengths_is_made_again(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'db'}")
    tables.create(engine)
    with engine.begin() as c:  # the index as the first UI shipped it
        c.exec_driver_sql("DROP INDEX ix_trajectories_facts")
        c.exec_driver_sql("CREATE INDEX ix_trajectories_facts ON trajectories (job, failure, reward, policy, t_queue, "
                          "t_init, t_run, t_eval)")
    tables.create(engine)
    with engine.connect() as c:
        assert [r[2] for r in c.exec_driver_sql("PRAGMA index_info(ix_trajectories_facts)")][-1] == "truncated"
        for columns in ("seq, reward, failure, t_queue, t_init, t_run, t_eval, policy, t_end",
                        "policy, reward, t_end, generated, turns, tool_errors, truncated"):  # the job's sums, its curves
            plan = " ".join(r[3] for r in c.exec_driver_sql(
                f"EXPLAIN QUERY PLAN SELECT {columns} FROM trajectories INDEXED BY ix_trajectories_facts WHERE job = 'j'"))
            assert "COVERING INDEX ix_trajectories_facts" in plan  # the first view of a job reads no row


def test_the_token_view_carries_the_version_of_each_generated_token():
    t = {"job": "j", "prompt": 0, "sample": 0, "tokenIds": [5, 6, 7, 8, 9], "promptLength": 1,
         "lossMask": [0, 1, 1, 1, 1], "logprobs": [None, -0.1, -0.2, -0.3, -0.4],
         "turns": [{"generatedStart": 1, "generatedEnd": 5}],
         "versionSpans": [{"version": 3, "start": 1, "end": 3}, {"version": 4, "start": 3, "end": 5}]}
    view = decode.decode(t, None)["sequences"][0]["tokenView"]
    assert [k.get("version") for k in view["tokens"]] == [None, 3, 3, 4, 4] and view["versions"] == [3, 4]
