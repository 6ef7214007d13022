"""The TRL adapter's logic (rolloutd.integrations.trl.rollouts, no torch): trajectories → TRL rows
token for token, env_mask over observations, infrastructure failures out of the loss and unscored,
policy versions checked, TRL's prompt runs mapped to exactly one named batch. The client here is a
recording stand-in; test_trl_train.py runs the same code under the real GRPOTrainer and rolloutd."""
from __future__ import annotations

import pytest

from rolloutd.client.batch import Batch
from rolloutd.integrations.trl import RolloutSource, StalePolicy, to_trl

ROWS = [{"id": f"q{i}", "question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]


def traj(prompt, sample, reward=1.0, version=None, ids=(1, 2, 3, 10, 11), plen=3, failure="none"):
    n = len(ids)
    mask = [0] * plen + [1] * (n - plen)
    return {"prompt": prompt, "sample": sample, "taskId": f"q{prompt}", "tokenIds": list(ids), "promptLength": plen,
            "lossMask": mask, "logprobs": [None] * plen + [-0.5] * (n - plen), "reward": reward,
            "failure": {"kind": failure}, "policyVersion": version, "policyVersions": [] if version is None else [version]}


def test_multi_turn_rows_mask_observations_and_keep_ids_and_logprobs():
    # prompt [1 2 3], turn 1 generates [10 11], observation [50 51 52], turn 2 generates [12]
    t = {"tokenIds": [1, 2, 3, 10, 11, 50, 51, 52, 12], "promptLength": 3,
         "lossMask": [0, 0, 0, 1, 1, 0, 0, 0, 1], "logprobs": [None, None, None, -0.1, -0.2, None, None, None, -0.3],
         "reward": 0.0, "failure": {"kind": "agent"}, "policyVersions": [2, 3]}
    row = to_trl(t, fallback_prompt=[], pad_id=0)
    assert row["prompt_ids"] + row["completion_ids"] == t["tokenIds"]
    assert row["env_mask"] == [1, 1, 0, 0, 0, 1]
    assert row["logprobs"] == [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3]
    assert row["rolloutd_reward"] == 0.0 and row["rolloutd_failure"] == "agent" and row["rolloutd_policy_version"] == 3


def test_infra_failure_is_unscored_and_out_of_the_loss():
    failed = {"tokenIds": [], "promptLength": 0, "lossMask": [], "logprobs": [], "reward": None,
              "failure": {"kind": "infra", "reason": "sandbox died"}}
    row = to_trl(failed, fallback_prompt=[1, 2, 3], pad_id=7)
    assert row["rolloutd_reward"] is None and row["rolloutd_failure"] == "infra"
    assert row["prompt_ids"] == [1, 2, 3] and row["completion_ids"] == [7] and row["env_mask"] == [0]
    partial = traj(0, 0, reward=None, failure="infra")
    row = to_trl(partial, fallback_prompt=[], pad_id=7)
    assert row["completion_ids"] == [10, 11] and row["env_mask"] == [0, 0] and row["rolloutd_reward"] is None


def test_bad_trajectories_are_refused():
    t = traj(0, 0)
    t["lossMask"][0] = 1
    with pytest.raises(ValueError, match="prompt tokens"):
        to_trl(t, fallback_prompt=[], pad_id=0)
    t = traj(0, 0)
    t["logprobs"][-1] = None
    with pytest.raises(ValueError, match="no logprob"):
        to_trl(t, fallback_prompt=[], pad_id=0)


class FakeClient:
    """Records the batch requests; answers with groups built by `make_groups(indices)`."""

    def __init__(self, make_groups):
        self.make_groups, self.requests = make_groups, []

    def request_batch(self, job, batch=None, prompts=None):
        self.requests.append(prompts)
        return {"batch": len(self.requests)}

    def batch(self, job, k, wait=True, timeout=None, all_groups=False):
        assert wait and all_groups
        groups = [{"group": i, "prompt": p, "state": "counted", "samples": s}
                  for i, (p, s) in enumerate(self.make_groups(self.requests[-1]))]
        return Batch.from_wire({"batch": k, "state": "complete", "target": len(groups), "counted": len(groups),
                                "groups": groups})


class FakeTrainer:
    class state:
        global_step = 0

    class model:
        training = True

    class processing_class:
        eos_token_id = 9

    num_generations = 2


def prompts_of(*indices, g=2):
    return [[{"role": "user", "content": ROWS[i]["question"]}] for i in indices for _ in range(g)]


def test_rollout_func_asks_for_exactly_trls_prompts_and_returns_their_rows():
    client = FakeClient(lambda idx: [(p, [traj(p, 0, 1.0), traj(p, 1, 0.0)]) for p in idx])
    src = RolloutSource(client, "job", ROWS)
    out = src.rollout_func(prompts_of(2, 0), FakeTrainer)
    assert client.requests == [[2, 0]]
    assert len(out["prompt_ids"]) == 4 and out["rolloutd_reward"] == [1.0, 0.0, 1.0, 0.0]
    assert out["completion_ids"][0] == [10, 11] and out["env_mask"][0] == [1, 1]
    assert src.reward([], [], rolloutd_reward=[1.0, None]) == [1.0, None]
    assert src.calls[-1].stale == 0 and src.calls[-1].versions == ["0"]


def test_rollout_func_checks_policy_versions():
    client = FakeClient(lambda idx: [(p, [traj(p, 0, 1.0, version=1), traj(p, 1, 0.0, version=2)]) for p in idx])
    trainer = FakeTrainer()
    trainer.state = type("S", (), {"global_step": 2})
    with pytest.raises(StalePolicy, match="TRL holds version 2"):
        RolloutSource(client, "job", ROWS).rollout_func(prompts_of(1), trainer)
    src = RolloutSource(client, "job", ROWS, on_stale="log")
    src.rollout_func(prompts_of(1), trainer)
    assert src.calls[-1].stale == 1 and src.calls[-1].versions == ["1", "2"]


def test_rollout_func_refuses_what_it_cannot_map():
    client = FakeClient(lambda idx: [(p, [traj(p, 0), traj(p, 1)]) for p in idx])
    src = RolloutSource(client, "job", ROWS)
    with pytest.raises(ValueError, match="runs of num_generations"):
        src.rollout_func(prompts_of(0, g=1) + prompts_of(1, g=1), FakeTrainer)
    with pytest.raises(KeyError, match="not in rolloutjob"):
        src.rollout_func([[{"role": "user", "content": "?"}]] * 2, FakeTrainer)
    wrong = FakeClient(lambda idx: [(3, [traj(3, 0), traj(3, 1)]) for _ in idx])
    with pytest.raises(RuntimeError, match="not the requested"):
        RolloutSource(wrong, "job", ROWS).rollout_func(prompts_of(0), FakeTrainer)
    with pytest.raises(ValueError, match="same 'question'"):
        RolloutSource(client, "job", ROWS + ROWS[:1])
