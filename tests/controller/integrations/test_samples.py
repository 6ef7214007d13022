"""The trainers' shared sample logic (rolloutd.integrations.samples, no trainer installed): a trajectory split
into prompt and response token for token, per-token policy versions, and groups whose infrastructure failures
are replaced by fresh rollouts of the same prompt (never scored) or end in an error. tests/rl/test_verl_*.py and
test_skyrl_*.py run the same code under verl's and SkyRL's own machinery against a real controller."""
from __future__ import annotations

import asyncio

import pytest

from rolloutd.client.batch import Batch
from rolloutd.integrations.samples import GroupSource, NoUsableSample, split, token_versions, usable


def traj(prompt=0, sample=0, reward=1.0, failure="none", group=1):
    # prompt [1 2 3], turn 1 generates [10 11], observation [50 51], turn 2 generates [12]
    t = {"job": "j", "prompt": prompt, "sample": sample, "group": group, "taskId": f"q{prompt}",
         "tokenIds": [1, 2, 3, 10, 11, 50, 51, 12], "promptLength": 3, "lossMask": [0, 0, 0, 1, 1, 0, 0, 1],
         "logprobs": [None, None, None, -0.1, -0.2, None, None, -0.3], "reward": reward, "failure": {"kind": failure},
         "finishReason": "stop", "policyVersion": 2, "policyVersions": [2, 3],
         "turns": [{"generatedStart": 3, "generatedEnd": 5, "observationStart": 5, "observationEnd": 7},
                   {"generatedStart": 7, "generatedEnd": 8}]}
    if failure == "infra":
        t["reward"] = None
    return t


def test_split_keeps_ids_masks_observations_and_logprobs():
    s = split(traj())
    assert s.prompt_ids == [1, 2, 3] and s.response_ids == [10, 11, 50, 51, 12]
    assert s.response_mask == [1, 1, 0, 0, 1] and s.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert s.versions == [2, 2, None, None, 3] and s.reward == 1.0 and (s.turns, s.observations) == (2, 1)
    assert s.key == {"job": "j", "prompt": 0, "group": 1, "sample": 0, "taskId": "q0"}


def test_token_versions_fall_back_to_the_trajectorys_version():
    t = traj()
    t["policyVersions"] = [7]  # not one per turn: the trajectory's own version on every generated token
    assert token_versions(t) == [2, 2, None, None, 2]


def test_token_versions_from_the_records_version_spans():
    """A record with per-token version spans (the weights changed inside turn 1, between its two tokens)."""
    t = {**traj(), "versionSpans": [{"version": 2, "start": 3, "end": 4}, {"version": 3, "start": 4, "end": 5},
                                    {"version": 3, "start": 7, "end": 8}]}
    assert token_versions(t) == [2, 3, None, None, 3] == split(t).versions


def test_unusable_and_malformed_trajectories():
    assert not usable(traj(failure="infra")) and usable(traj()) and usable(traj(reward=0.0, failure="agent"))
    assert not usable({**traj(), "tokenIds": [], "segments": [{}, {}]})
    bad = traj()
    bad["lossMask"][0] = 1
    with pytest.raises(ValueError, match="prompt tokens"):
        split(bad)
    bad = traj()
    bad["logprobs"][-1] = None
    with pytest.raises(ValueError, match="no logprob"):
        split(bad)


class FakeAsyncClient:
    """Answers each batch request with `make(prompt, k)` samples per prompt; records the requests."""

    def __init__(self, make, samples=2):
        self.make, self.samples, self.requests = make, samples, []

    async def get(self, job):
        return {"spec": {"samplesPerPrompt": self.samples}}

    async def request_batch(self, job, prompts=None):
        self.requests.append(list(prompts))
        return {"batch": len(self.requests)}

    async def batch(self, job, k, wait=True, timeout=None, all_groups=False):
        groups = [{"group": 10 * k + i, "prompt": p, "samples": self.make(p, k)} for i, p in enumerate(self.requests[k - 1])]
        return Batch.from_wire({"batch": k, "state": "complete", "groups": groups})


def test_an_infra_failure_is_replaced_by_a_fresh_sample_of_the_same_prompt():
    # sample 1 of every group fails on infrastructure: its place goes to sample 0 of a fresh group
    client = FakeAsyncClient(lambda p, k: [traj(p, 0, reward=float(k), group=k), traj(p, 1, failure="infra", group=k)])
    src = GroupSource(client, "j")
    (g,) = asyncio.run(src.groups([4], 2))
    assert client.requests == [[4], [4]]
    assert [t["group"] for t in g] == [1, 2] and all(usable(t) for t in g)
    assert src.replaced == 1 and len(src.failures) == 2


def test_a_prompt_that_keeps_failing_raises_instead_of_scoring():
    client = FakeAsyncClient(lambda p, k: [traj(p, 0, failure="infra"), traj(p, 1, failure="infra")])
    with pytest.raises(NoUsableSample, match=r"prompts \[0, 1\]: fewer than 2"):
        asyncio.run(GroupSource(client, "j", max_replacements=2).groups([0, 1], 2))
    assert client.requests == [[0, 1]] * 3  # the batch, then two rounds of fresh groups of the prompts still short


def test_prompts_asked_for_one_by_one_in_a_turn_become_one_batch():
    """verl asks row by row; a job serves one batch at a time: the prompts asked for together go as one batch
    (a repeated prompt waits for the next one), each caller gets its own prompt's group."""
    client = FakeAsyncClient(lambda p, k: [traj(p, 0, group=k), traj(p, 1, group=k)])
    src = GroupSource(client, "j")

    async def go():
        return await asyncio.gather(src.group(3, 2), src.group(1, 2), src.group(3, 2))

    a, b, c = asyncio.run(go())
    assert client.requests == [[3, 1], [3]]
    assert [t["prompt"] for t in a + b + c] == [3, 3, 1, 1, 3, 3] and a[0]["group"] == 1 and c[0]["group"] == 2


def test_the_trainers_n_must_be_the_jobs_samples_per_prompt():
    client = FakeAsyncClient(lambda p, k: [traj(p, 0)], samples=1)
    with pytest.raises(ValueError, match="samplesPerPrompt=1"):
        asyncio.run(GroupSource(client, "j").groups([0], 2))
