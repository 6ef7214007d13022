"""The job's numbers the dashboard and `rolloutctl describe` show are running sums (`work/stats.JobStats`), not a
recount per view: they must equal a full recount of the delivered trajectories after any mix of results
(scored, agent, config and infra failures, infra retries, a last attempt's infra failure) and after a controller
restart (the sums are rebuilt from the store). A finished job keeps its numbers, not its sums; a deleted job keeps
nothing. Also: a node's seconds since its last call come from its calls, not from its registration. A real controller; the test is the node, over the real node protocol."""
from __future__ import annotations

import sqlite3
import time
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.ui_protocol import P, Cluster

KEY = "team-c/mix"


@pytest.fixture
def mixed(own_cluster):
    own_cluster.create_job("team-c", "mix", 8, pipeline={"maxAttempts": 2})  # 16 rollouts, all leased
    return own_cluster


def recount(cluster: Cluster) -> dict:
    """The delivered trajectories counted again from the feed (the API's ndjson), and from SQL over the store."""
    docs = cluster.seqs("team-c", "mix")
    kinds = Counter(d["failure"]["kind"] for d in docs)
    scored = [d["reward"] for d in docs if d["failure"]["kind"] != "infra" and d["reward"] is not None]
    reasons = Counter((d["failure"]["kind"], d["failure"]["reason"].strip()[:200]) for d in docs
                      if d["failure"]["kind"] in ("agent", "infra", "config"))
    with sqlite3.connect(cluster.controller.data_dir / "rolloutd.db") as db:
        sql = {k: n for k, n in db.execute("SELECT failure, count(*) FROM trajectories WHERE job = ? GROUP BY failure",
                                           (KEY,))}
    assert sql == dict(kinds)
    return {"delivered": len(docs), "byKind": dict(kinds),
            "infraRate": round(kinds["infra"] / len(docs), 4) if docs else None,
            "rewardMean": round(sum(scored) / len(scored), 4) if scored else None, "reasons": reasons}


def shown(cluster: Cluster, ui: httpx.Client) -> tuple[dict, dict]:
    """What `GET …/stats` (rolloutctl describe) answers, and what the job page's JSON shows (its counts and its
    failures by reason), once the page's shared build is at least as new as the stats answer."""
    api = cluster.admin.get(f"{P}/namespaces/team-c/rolloutjobs/mix/stats").json()
    out = {}

    def fresh() -> bool:
        page = ui.get("/ui/api/jobs/team-c/mix").json()
        out.update(page["trajectories"], reasons=Counter({(f["kind"], r["reason"]): r["count"]
                                                          for f in page["failures"] for r in f["reasons"]}))
        return page["trajectories"]["delivered"] == api["delivered"]
    cluster.wait(fresh, "the job page's summary after the stats answer")
    return {k: api[k] for k in ("delivered", "byKind", "infraRate", "rewardMean")}, out


def check(cluster: Cluster, ui: httpx.Client) -> dict:
    want = recount(cluster)
    api, page = shown(cluster, ui)
    assert api == {k: v for k, v in want.items() if k != "reasons"}
    assert page == want
    return want


def test_the_running_counts_equal_a_full_recount_through_retries_and_a_restart(mixed):
    cluster = mixed
    ui = httpx.Client(base_url=cluster.controller.url, timeout=30,
                      headers={"Authorization": f"Bearer {cluster.controller.token}"})
    assert check(cluster, ui)["delivered"] == 0  # the sums start before the first trajectory
    cluster.report(KEY, 3)  # scored: reward 1 for sample 0, else 0
    cluster.report(KEY, 2, reward=0.0, failure={"kind": "agent", "reason": "no answer"})
    check(cluster, ui)  # the first view summed all; the next ones only the rows after it
    cluster.report(KEY, 2, reward=None, failure={"kind": "infra", "reason": "sandbox died"})  # retried: not delivered
    cluster.report(KEY, 1, reward=0.0, failure={"kind": "agent", "reason": "bad format"})
    assert check(cluster, ui)["delivered"] == 6
    assert cluster.lease(KEY, 4) == 2  # the two infra failures, queued again for their second (last) attempt
    retried = cluster.leases[KEY][-2:]
    cluster.leases[KEY] = cluster.leases[KEY][:-2]
    cluster.leases[KEY][:0] = retried
    cluster.report(KEY, 1, reward=None, failure={"kind": "infra", "reason": "sandbox died"})  # final: delivered
    cluster.report(KEY, 1, reward=0.5)
    numbers = check(cluster, ui)
    assert numbers["byKind"] == {"none": 4, "agent": 3, "infra": 1}

    cluster.controller.restart()  # SIGKILL: the sums are gone with the process and made again from the store
    assert check(cluster, ui) == numbers
    cluster.report(KEY, 2, reward=1.0)
    cluster.report(KEY, 1, reward=0.0, failure={"kind": "agent", "reason": "no answer"})
    cluster.report(KEY, 1, reward=None, failure={"kind": "config", "reason": "image refused"})  # fails the job
    numbers = check(cluster, ui)
    assert numbers["byKind"] == {"none": 6, "agent": 4, "infra": 1, "config": 1}
    assert numbers["reasons"][("agent", "no answer")] == 3 and numbers["reasons"][("infra", "sandbox died")] == 1
    ui.close()


def test_a_nodes_seconds_since_its_last_call_count_from_that_call(mixed):
    """The job page's node table: a daemon that just called is not shown as silent since it registered."""
    cluster = mixed
    time.sleep(2.0)  # a gap since the registration (no page has been built for this job yet)
    called = time.time()
    r = cluster.node_api.post(f"{P}/nodes/{cluster.nodes[KEY]}/heartbeat", json={"stages": {}, "full": False})
    assert r.status_code == 200, r.text
    with httpx.Client(base_url=cluster.controller.url, timeout=30,
                      headers={"Authorization": f"Bearer {cluster.controller.token}"}) as ui:
        [node] = ui.get("/ui/api/jobs/team-c/mix").json()["nodes"]
    assert node["name"] == "node-mix" and node["inflight"] == 16
    assert node["secondsSinceBeat"] <= round(time.time() - called, 1) + 0.1


def kept(cluster: Cluster) -> dict[str, float]:
    """What the controller's running sums hold in memory, from /metrics."""
    out = {}
    for fam in text_string_to_metric_families(cluster.admin.get("/metrics").text):
        for s in fam.samples:
            if s.name == "rolloutd_job_stats_jobs":
                out[s.labels["kind"]] = s.value
            elif s.name == "rolloutd_job_stats_stage_times":
                out["stage_times"] = s.value
    return out


def test_a_finished_jobs_sums_give_way_to_its_numbers_and_a_deleted_jobs_are_gone(mixed):
    """A finished job's stage times are not kept (its numbers, rendered once, are), the numbers stay equal to a
    recount, a restarted controller makes them again from the store, and a deleted job leaves nothing behind."""
    cluster = mixed
    ui = httpx.Client(base_url=cluster.controller.url, timeout=30,
                      headers={"Authorization": f"Bearer {cluster.controller.token}"})
    cluster.report(KEY, 12)
    cluster.report(KEY, 3, reward=0.0, failure={"kind": "agent", "reason": "no answer"})
    check(cluster, ui)
    assert kept(cluster) == {"running": 1, "final": 0, "stage_times": 4 * 15}
    cluster.report(KEY, 1)  # the last one: the job succeeds
    cluster.wait(lambda: cluster.job("team-c", "mix")["status"].get("phase") == "Succeeded", "the job succeeded")
    cluster.wait(lambda: ui.get("/ui/api/jobs/team-c/mix").json()["phase"] == "Succeeded", "the page's build after it")
    numbers = check(cluster, ui)
    assert numbers["delivered"] == 16 and kept(cluster) == {"running": 0, "final": 1, "stage_times": 0}

    cluster.controller.restart()  # the numbers are made again from the store
    assert check(cluster, ui) == numbers
    assert kept(cluster) == {"running": 0, "final": 1, "stage_times": 0}

    assert cluster.admin.delete(f"{P}/namespaces/team-c/rolloutjobs/mix").status_code in (200, 202)
    cluster.wait(lambda: cluster.admin.get(f"{P}/namespaces/team-c/rolloutjobs/mix").status_code == 404, "the job gone")
    cluster.wait(lambda: kept(cluster) == {"running": 0, "final": 0, "stage_times": 0}, "its numbers gone too")
    ui.close()
