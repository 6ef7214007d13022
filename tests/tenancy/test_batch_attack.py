"""One tenant's batch does not stall the others (issue 36): while team-a's job opens a batch of thousands of groups
(tens of thousands of rollouts), team-b's node keeps beating and keeps its lease, and team-b's GETs are answered
(the real controller, with the local executor so team-b's job is admitted; the test is team-b's node).

The batch opens in a worker thread a step at a time (`Scheduler.fill_batch`); the assertions are on behaviour, not
on a latency: beats and GETs answered before the batch's answer came back, no lease lost, the result accepted, and
every group opened exactly once although the loop's own writers ran between the steps.
"""
from __future__ import annotations

import threading

from support.tenancy_helpers import job, jobs_path, put_policy, tenant
from support.waiting import wait_until

from rolloutd.agents.engine.model_dirs import model_dir
from support.sim.noop import HealthServer
from rolloutd.crds.node import NODE_PROTOCOL
from rolloutd.crds.trajectory import Failure, Trajectory

GROUPS = 1500  # × 8 samples: 12 000 rollouts, ~375 steps of the fill


def _result(lease: dict) -> dict:
    t = Trajectory(job="", prompt=lease["prompt"], sample=lease["sample"], task_id=str(lease["task"].get("id")),
                   finish_reason="stop", reward=1.0, failure=Failure(), node="sim", attempt=lease["attempt"])
    return {"attemptId": lease["attemptId"], "trajectory": t.wire()}


def test_a_huge_batch_leaves_other_tenants_beats_leases_and_reads_answered(local_kube):
    health = HealthServer()  # a backend's /health: team-b's items lease; nobody generates here
    try:
        with local_kube.client() as admin:
            _attack(local_kube, admin, health.urls[0])
    finally:
        health.close()


def _attack(kube, admin, backend: str) -> None:
    put_policy(admin, "teamb", backends=[backend])
    spec = {"llm": {"tokenizer": str(model_dir("tiny")), "backends": [{"url": backend}]}, "samplesPerPrompt": 1,
            "executor": {"kind": "local", "nodes": 0}, "tasks": {"limit": 1}, "pipeline": {"leaseSeconds": 5}}
    with tenant(kube, "teamb") as b:
        assert b.post(jobs_path("teamb"), json=job("mine", **spec)).status_code == 201
        mine = f"{jobs_path('teamb')}/mine"
        node = admin  # the admin token acts as any node (a simulated one)
        reg = node.post(f"{mine}/nodes/register", json={"job": "teamb/mine", "name": "b0", "protocol": NODE_PROTOCOL})
        assert reg.status_code == 200, reg.text
        at = f"{mine}/nodes/{reg.json()['nodeId']}"
        leases: list[dict] = []

        def leased() -> bool:
            r = node.post(f"{at}/lease", json={"maxItems": 1, "wait": 2.0})
            r.raise_for_status()
            leases.extend(r.json().get("leases", []))
            return bool(leases)
        wait_until(leased, 60, "team-b's rollout leased")
        aid = leases[0]["attemptId"]

        big = {**spec, "samplesPerPrompt": 8, "tasks": {"limit": 64}, "batches": {"groups": GROUPS}}
        big.pop("pipeline")
        assert admin.post(jobs_path("default"), json=job("big", **big)).status_code == 201
        answer: dict = {}
        done = threading.Event()

        def batch() -> None:
            try:
                r = admin.post(f"{jobs_path('default')}/big/batches", json={}, timeout=600)
                answer.update(status=r.status_code, body=r.json())
            finally:
                done.set()

        beats, gets, lost = 0, 0, []
        opener = threading.Thread(target=batch)
        opener.start()
        try:
            while not done.is_set():
                r = node.post(f"{at}/heartbeat", json={"stages": {aid: "run"}, "full": True}, timeout=60)
                assert r.status_code == 200, r.text
                lost += [a for a in r.json().get("cancel", []) + r.json().get("unknown", []) if a == aid]
                beats += not done.is_set()
                assert b.get(mine, timeout=60).status_code == 200
                gets += not done.is_set()
                done.wait(0.2)  # a daemon's beat period at this lease (leaseSeconds / 6 ≈ 0.8 s) is longer
        finally:
            opener.join()
        assert answer.get("status") == 200 and answer["body"]["openedGroups"] == GROUPS, answer
        assert beats >= 3 and gets >= 3, (beats, gets)  # answered while the batch was still opening
        assert lost == [], lost  # team-b's lease never expired nor was taken back
        ack = node.post(f"{at}/results", json={"results": [_result(leases[0])]})
        assert ack.status_code == 200 and ack.json()["accepted"] == [aid], ack.text
        groups = admin.get(f"{jobs_path('default')}/big/batches/1").json()
        assert groups["openedGroups"] == GROUPS, groups  # each group opened once across the steps
        total = lambda: admin.get(f"{jobs_path('default')}/big").json()["status"].get("counts", {}).get("total")  # noqa: E731
        wait_until(lambda: total() == GROUPS * 8, 60, "the operator's count of the batch's rollouts")
