"""`Batch.to_arrays`: padding, masks, logprobs, GRPO advantages, infra rows left out."""
from __future__ import annotations

import math

import pytest
from support.client_fake import traj

from rolloutd.client import Batch, grpo_advantages


def row(prompt, sample, reward, ids, plen, version=0):
    mask = [0] * plen + [1] * (len(ids) - plen)
    lps = [None] * plen + [-0.1 * (i + 1) for i in range(len(ids) - plen)]
    return traj(0, prompt, sample, reward, tokenIds=ids, promptLength=plen, lossMask=mask, logprobs=lps,
                policyVersion=version)


def batch() -> Batch:
    multi_turn = traj(0, 8, 2, 0.0, tokenIds=[5, 6, 7, 8, 9, 10], promptLength=2, lossMask=[0, 0, 1, 0, 1, 1],
                      logprobs=[None, None, -1.0, None, -2.0, -3.0], policyVersion=1)
    return Batch.from_wire({"batch": 0, "state": "complete", "target": 2, "counted": 2, "groups": [
        {"group": "g0", "prompt": 7, "state": "counted", "rewards": [1.0, 0.0, None],
         "samples": [row(7, 0, 1.0, [1, 2, 3, 4], 2), row(7, 1, 0.0, [1, 2, 3], 2), row(7, 2, None, [1, 2], 2)]},
        {"group": "g1", "prompt": 8, "state": "counted", "rewards": [1.0, 1.0, 0.0],
         "samples": [row(8, 0, 1.0, [5, 6, 7], 2, 1), row(8, 1, 1.0, [5, 6, 7, 8, 9], 2, 1), multi_turn]},
    ]})


def test_rows_are_padded_right_and_masks_mark_real_and_generated_tokens():
    a = batch().to_arrays(pad_id=-1)
    n = 5  # 6 samples, one infrastructure failure left out
    assert all(len(a[k]) == n for k in a)
    assert a["input_ids"] == [[1, 2, 3, 4, -1, -1], [1, 2, 3, -1, -1, -1], [5, 6, 7, -1, -1, -1],
                              [5, 6, 7, 8, 9, -1], [5, 6, 7, 8, 9, 10]]
    assert a["attention_mask"][1] == [1, 1, 1, 0, 0, 0]
    assert a["loss_mask"][0] == [0, 0, 1, 1, 0, 0]
    assert a["loss_mask"][4] == [0, 0, 1, 0, 1, 1]           # the tool observation is not trained on
    assert a["rollout_logprobs"][4] == [0.0, 0.0, -1.0, 0.0, -2.0, -3.0]
    assert a["rollout_logprobs"][0] == pytest.approx([0.0, 0.0, -0.1, -0.2, 0.0, 0.0])
    assert a["group_index"] == [0, 0, 1, 1, 1]
    assert a["prompt_index"] == [7, 7, 8, 8, 8] and a["sample_index"] == [0, 1, 0, 1, 2]
    assert a["prompt_lengths"] == [2] * 5 and a["response_lengths"] == [2, 1, 1, 3, 3]
    assert a["policy_versions"] == [0, 0, 1, 1, 1]
    assert a["rewards"] == [1.0, 0.0, 1.0, 1.0, 0.0]


def test_infra_failures_are_left_out_and_counted_never_scored_zero():
    b = batch()
    assert b.infra_failures == 1
    a = b.to_arrays()
    assert [1, 2] + [0] * 4 not in a["input_ids"]
    # group 0's baseline is computed over its usable rows only: [1, 0]
    s = math.sqrt(0.5)
    assert a["advantages"][:2] == pytest.approx([0.5 / (s + 1e-4), -0.5 / (s + 1e-4)])


def test_grpo_advantages_per_group_with_the_sample_std():
    a = batch().to_arrays(eps=0.0)
    r = [1.0, 1.0, 0.0]
    mean, std = 2 / 3, math.sqrt(sum((x - 2 / 3) ** 2 for x in r) / 2)
    assert a["advantages"][2:] == pytest.approx([(x - mean) / std for x in r])
    assert grpo_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert grpo_advantages([0.5]) == [0.0] and grpo_advantages([]) == []


def test_pad_to_fixes_the_width_and_refuses_to_truncate():
    a = batch().to_arrays(pad_to=8)
    assert {len(r) for k in ("input_ids", "attention_mask", "loss_mask", "rollout_logprobs") for r in a[k]} == {8}
    with pytest.raises(ValueError, match="longest"):
        batch().to_arrays(pad_to=5)


def test_a_missing_loss_mask_is_derived_from_the_logprobs():
    t = traj(0, 0, 0, 1.0, tokenIds=[1, 2, 3], lossMask=[], logprobs=[None, -0.5, -0.25])
    b = Batch.from_wire({"batch": 0, "state": "complete", "target": 1, "counted": 1,
                         "groups": [{"group": 1, "prompt": 0, "samples": [t]}]})
    a = b.to_arrays()
    assert a["loss_mask"] == [[0, 1, 1]] and a["rewards"] == [1.0] and b.groups[0].rewards == [1.0]


def test_an_empty_batch_gives_empty_rows():
    a = Batch(batch=0, state="complete", target=0, counted=0).to_arrays()
    assert a["input_ids"] == [] and a["advantages"] == []


def test_numpy_on_request():
    np = pytest.importorskip("numpy")
    a = batch().to_arrays(numpy=True)
    assert a["input_ids"].shape == (5, 6) and a["input_ids"].dtype == np.int64
    assert a["rollout_logprobs"].dtype == np.float32 and a["advantages"].shape == (5,)
    assert a["policy_versions"] == [0, 0, 1, 1, 1]


def test_a_trajectory_with_segments_gives_one_row_per_sequence_with_its_reward_and_advantage():
    """A harness that rewrote its history: `segments` (validated by the Trajectory model), flat fields empty."""
    from rolloutd.crds.trajectory import Segment, Trajectory

    segs = [Segment(token_ids=[1, 2, 3, 4], prompt_length=2, loss_mask=[0, 0, 1, 1], logprobs=[None, None, -0.5, -0.6],
                    calls=1),
            Segment(token_ids=[9, 3], prompt_length=1, loss_mask=[0, 1], logprobs=[None, -0.7], calls=1)]
    wire = Trajectory(job="j", prompt=3, sample=1, reward=1.0, segments=segs).wire()
    assert wire["tokenIds"] == [] and wire["segments"][1]["tokenIds"] == [9, 3]
    b = Batch.from_wire({"batch": 1, "state": "complete", "target": 1, "counted": 1, "groups": [
        {"group": "g", "prompt": 3, "samples": [row(3, 0, 0.0, [1, 5], 1), {**wire, "reward": 1.0}]}]})
    a = b.to_arrays(pad_id=0)
    assert a["input_ids"] == [[1, 5, 0, 0], [1, 2, 3, 4], [9, 3, 0, 0]]
    assert a["loss_mask"][1:] == [[0, 0, 1, 1], [0, 1, 0, 0]] and a["rollout_logprobs"][2] == [0.0, -0.7, 0.0, 0.0]
    assert a["segment_index"] == [0, 0, 1] and a["sample_index"] == [0, 1, 1] and a["prompt_lengths"] == [1, 2, 1]
    assert a["rewards"] == [0.0, 1.0, 1.0] and a["advantages"][1] == a["advantages"][2] > 0 > a["advantages"][0]
    with pytest.raises(ValueError, match="not both"):
        Trajectory(job="j", prompt=0, sample=0, token_ids=[1], segments=segs)
    with pytest.raises(ValueError, match="lossMask"):
        Segment(token_ids=[1, 2], loss_mask=[1])


def test_token_versions_follow_the_version_spans_of_each_generated_token():
    split = traj(0, 9, 0, 1.0, tokenIds=[5, 6, 7, 8, 9, 10], promptLength=2, lossMask=[0, 0, 1, 1, 1, 1],
                 logprobs=[None, None, -1.0, -1.0, -2.0, -3.0], policyVersion=1,
                 versionSpans=[{"version": 1, "start": 2, "end": 4}, {"version": 2, "start": 4, "end": 6}])
    plain = traj(0, 9, 1, 0.0, tokenIds=[5, 6, 7], promptLength=2, lossMask=[0, 0, 1], logprobs=[None, None, -1.0],
                 policyVersion=1)
    b = Batch.from_wire({"batch": 0, "state": "complete", "target": 1, "counted": 1, "groups": [
        {"group": "g", "prompt": 9, "state": "counted", "rewards": [1.0, 0.0], "samples": [split, plain]}]})
    a = b.to_arrays()
    assert a["token_versions"] == [[None, None, 1, 1, 2, 2], [None] * 6]
    if pytest.importorskip("numpy"):
        assert b.to_arrays(numpy=True)["token_versions"].tolist() == [[-1, -1, 1, 1, 2, 2], [-1] * 6]
