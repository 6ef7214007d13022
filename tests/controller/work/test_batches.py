"""Batch mode and DAPO in the scheduler, in-process with scripted rewards per prompt (the
scheduler's logic only; tests/e2e/test_dapo.py runs the same through real daemons and vLLM)."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rolloutd.controller.errors import BadRequest, Conflict
from rolloutd.controller.work.core import build_work
from rolloutd.controller.work.scheduler import Scheduler
from rolloutd.controller.store import Store
from rolloutd.crds.node import NODE_PROTOCOL, Heartbeat, RegisterRequest, Result, ResultBatch
from rolloutd.crds.rolloutjob import RolloutJob
from rolloutd.crds.trajectory import Failure, Trajectory
from rolloutd.crds.weight_labels import read_label
from support.example_job import example_doc

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "math-demo.yaml"


def make(tmp_path, store_location, *, prompts=20, samples=4, dapo=True, target=3, in_flight=4, carry=False, batches=None,
         max_staleness=None):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i}?", "answer": "1"}) + "\n" for i in range(prompts)))
    doc = example_doc()
    doc["spec"]["tasks"] = {"kind": "math", "source": str(data)}
    doc["spec"]["samplesPerPrompt"] = samples
    doc["spec"]["llm"]["backends"] = [{"url": "http://a"}]
    doc["spec"]["executor"]["nodes"] = 1  # one daemon leases everything (no fair-share cap)
    if dapo:
        doc["spec"]["dapo"] = {"enabled": True, "targetGroups": target, "maxInFlightGroups": in_flight, "carryOver": carry}
    else:
        doc["spec"]["dapo"] = {"enabled": False}
        doc["spec"]["batches"] = batches or {"groups": target, "maxInFlightGroups": in_flight}
    if max_staleness is not None:
        doc["spec"]["policy"] = {"maxStaleness": max_staleness}
    store = Store(store_location)
    store.apply(RolloutJob.model_validate(doc))
    sched = Scheduler(build_work(store))
    node = sched.work.registry.register(RegisterRequest(job="math-demo", protocol=NODE_PROTOCOL, name="n")).node_id
    return store, sched, node


def lease_all(sched, node):
    return asyncio.run(sched.work.attempts.lease(node, 1000)).leases


def report(sched, node, leases, reward_of, infra=()):
    results = []
    for l in leases:
        if l.prompt in infra:
            t = Trajectory(job="x", prompt=0, sample=0, failure=Failure(kind="infra", reason="sandbox died"))
        else:
            t = Trajectory(job="x", prompt=0, sample=0, reward=reward_of(l.prompt, l.sample))
        results.append(Result(attempt_id=l.attempt_id, trajectory=t))
    return sched.work.calls.results(node, ResultBatch(results=results))


def mixed_every_third(prompt, sample):
    """Prompts 2, 5, 8, … are informative (mixed rewards); the others are all-right or all-wrong."""
    if prompt % 3 == 2:
        return float(sample % 2)
    return float(prompt % 3 == 0)


def test_dapo_fills_exactly_the_target_with_informative_groups(tmp_path, store_location):
    store, sched, node = make(tmp_path, store_location, target=3, in_flight=4)
    info = sched.request_batch("math-demo")
    assert info["batch"] == 1 and info["target"] == 3
    rounds = 0
    while True:
        leases = lease_all(sched, node)
        if not leases:
            break
        report(sched, node, leases, mixed_every_third)
        rounds += 1
    snap = asyncio.run(sched.batch("math-demo", 1))
    assert snap["state"] == "complete" and snap["counted"] == 3
    assert [g["prompt"] for g in snap["groups"]] == [2, 5, 8]
    assert all(len(set(g["rewards"])) > 1 for g in snap["groups"])
    every = asyncio.run(sched.batch("math-demo", 1, include_all=True))
    states = {g["prompt"]: g["state"] for g in every["groups"]}
    assert states[0] == "uninformative" and states[1] == "uninformative"


def test_replenishment_opens_a_new_prompt_as_soon_as_a_group_is_uninformative(tmp_path, store_location):
    store, sched, node = make(tmp_path, store_location, target=2, in_flight=2)
    sched.request_batch("math-demo")
    first = lease_all(sched, node)
    assert sorted({l.prompt for l in first}) == [0, 1]  # two groups in flight
    g0 = [l for l in first if l.prompt == 0]
    report(sched, node, g0, lambda p, s: 1.0)  # prompt 0: all right → not informative
    nxt = lease_all(sched, node)
    assert {l.prompt for l in nxt} == {2}, "prompt 2 started while prompt 1 is still running"


def test_surplus_is_cancelled_when_the_target_is_met(tmp_path, store_location):
    store, sched, node = make(tmp_path, store_location, target=1, in_flight=3)
    sched.request_batch("math-demo")
    leases = lease_all(sched, node)
    assert sorted({l.prompt for l in leases}) == [0, 1, 2]
    p2 = [l for l in leases if l.prompt == 2]
    report(sched, node, p2, mixed_every_third)  # prompt 2 is informative: the batch is full
    others = [l for l in leases if l.prompt != 2]
    hb = sched.work.calls.heartbeat(node, Heartbeat(stages={l.attempt_id: "run" for l in others}))
    assert sorted(hb.cancel) == sorted(l.attempt_id for l in others)
    snap = asyncio.run(sched.batch("math-demo", 1))
    assert snap["state"] == "complete" and snap["cancelledRollouts"] == 8
    assert lease_all(sched, node) == []  # nothing more until the trainer asks for batch 2
    late = report(sched, node, others[:1], mixed_every_third)
    assert late.dropped[others[0].attempt_id] == "cancelled"


def test_carry_over_keeps_partial_groups_for_the_next_batch(tmp_path, store_location):
    store, sched, node = make(tmp_path, store_location, target=1, in_flight=3, carry=True)
    sched.request_batch("math-demo")
    leases = lease_all(sched, node)
    done_half = [l for l in leases if l.prompt == 0 and l.sample < 2]
    report(sched, node, done_half, mixed_every_third)
    report(sched, node, [l for l in leases if l.prompt == 2], mixed_every_third)  # batch 1 full
    running = [l for l in leases if l.prompt in (0, 1) and l not in done_half]
    hb = sched.work.calls.heartbeat(node, Heartbeat(stages={l.attempt_id: "run" for l in running}))
    assert hb.cancel == [] and hb.unknown == []  # the partial groups keep running
    with pytest.raises(BadRequest):
        sched.request_batch("math-demo", 3)  # batches come in order
    assert sched.request_batch("math-demo")["batch"] == 2
    rest = [l for l in leases if l.prompt in (0, 1) and l not in done_half]
    report(sched, node, rest, lambda p, s: float(s % 2))  # both carried groups become informative
    snap = asyncio.run(sched.batch("math-demo", 2))
    assert snap["state"] == "complete" and {g["prompt"] for g in snap["groups"]} <= {0, 1}
    g0 = next((g for g in snap["groups"] if g["prompt"] == 0), None)
    assert g0 is None or len(g0["samples"]) == 4  # the carried group kept its two earlier samples


def test_infra_failed_sample_makes_its_group_incomplete_never_zero(tmp_path, store_location):
    store, sched, node = make(tmp_path, store_location, target=1, in_flight=2)
    doc = store.get("math-demo").wire()
    sched.request_batch("math-demo")
    for _ in range(5):  # prompt 0 keeps failing until its attempts are used up
        leases = lease_all(sched, node)
        if not leases:
            break
        report(sched, node, [l for l in leases if l.prompt == 0], mixed_every_third, infra={0})
    every = asyncio.run(sched.batch("math-demo", 1, include_all=True))
    g0 = next(g for g in every["groups"] if g["prompt"] == 0)
    assert g0["state"] == "incomplete" and g0["rewards"] == []
    assert doc["spec"]["pipeline"]["maxAttempts"] == 3


def test_plain_batches_count_every_complete_group_and_stop_after_count(tmp_path, store_location):
    store, sched, node = make(tmp_path, store_location, dapo=False, batches={"groups": 2, "count": 2})
    for k in (1, 2):
        assert sched.request_batch("math-demo")["batch"] == k
        while leases := lease_all(sched, node):
            report(sched, node, leases, lambda p, s: 1.0)
        snap = asyncio.run(sched.batch("math-demo", k))
        assert snap["state"] == "complete" and snap["counted"] == 2
        assert [g["prompt"] for g in snap["groups"]] == [2 * k - 2, 2 * k - 1]  # dataset order
    with pytest.raises(Conflict):
        sched.request_batch("math-demo")
    assert asyncio.run(sched.progress(store.get("math-demo"))).done


def test_cursor_survives_a_restart(tmp_path, store_location):
    store, sched, node = make(tmp_path, store_location, dapo=False, batches={"groups": 2})
    sched.request_batch("math-demo")
    while leases := lease_all(sched, node):
        report(sched, node, leases, lambda p, s: 1.0)
    again = Scheduler(build_work(store))  # the daemon carries on with its node id (a restart keeps the nodes)
    assert again.request_batch("math-demo")["batch"] == 2
    assert sorted({l.prompt for l in lease_all(again, node)}) == [2, 3]


def test_non_batch_jobs_refuse_batch_requests(tmp_path, store_location):
    store, sched, node = make(tmp_path, store_location, dapo=False)
    job = store.get("math-demo").model_copy(deep=True)
    with pytest.raises(BadRequest):
        doc = job.wire()
        doc["metadata"] = {"name": "oneshot"}
        doc["spec"]["batches"] = None
        store.apply(RolloutJob.model_validate(doc))
        sched.request_batch("oneshot")


def test_stale_samples_are_re_run(tmp_path, store_location):
    store, sched, node = make(tmp_path, store_location, dapo=False, batches={"groups": 1}, max_staleness=0)
    sched.request_batch("math-demo")
    leases = lease_all(sched, node)
    assert all(l.policy_version is None for l in leases)
    # in flight when version 1 comes: one version behind, more than the bound; the daemon is told to drop them
    answer = asyncio.run(sched.announce_policy("math-demo", 1, pause=False))
    assert answer["staleness"] == {"cancelledRollouts": 4, "sweptGroups": 0}
    hb = sched.work.calls.heartbeat(node, Heartbeat(stages={l.attempt_id: "run" for l in leases}))
    assert sorted(hb.unknown) == sorted(l.attempt_id for l in leases)
    again = lease_all(sched, node)
    assert len(again) == 4 and all(l.policy_version == 1 for l in again)
    asyncio.run(sched.announce_policy("math-demo", 2, pause=False))
    # a result that arrives generated by an older policy is run again (the per-sample check)
    again = lease_all(sched, node)
    old = [Result(attempt_id=l.attempt_id, trajectory=Trajectory(job="x", prompt=0, sample=0, reward=1.0,
                                                                 policy_version=1, policy_versions=[1]))
           for l in again]
    ack = sched.work.calls.results(node, ResultBatch(results=old))
    assert len(ack.accepted) == 4 and sched.work.feed.trajectories("math-demo") == []  # re-queued, not delivered
    assert len(lease_all(sched, node)) == 4
    assert sched.policy("math-demo")["staleness"]["cancelledRollouts"] == 8
    assert sched.policy("math-demo")["staleness"]["rerun"] == 4  # the per-sample re-runs, counted per job
    assert sched.work.stale.totals["rerun"] == 4  # /metrics: rolloutd_stale_rollouts_rerun_total


def test_a_counted_group_admitted_too_long_ago_leaves_the_running_batch(tmp_path, store_location):
    store, sched, node = make(tmp_path, store_location, dapo=False, batches={"groups": 2, "maxInFlightGroups": 2}, max_staleness=0)
    sched.request_batch("math-demo")
    leases = lease_all(sched, node)
    first = [l for l in leases if l.prompt == 0]
    report(sched, node, first, lambda p, s: float(s % 2))  # group of prompt 0 counted, admitted under no version
    assert asyncio.run(sched.batch("math-demo", 1))["counted"] == 1
    answer = asyncio.run(sched.announce_policy("math-demo", 1, pause=False))
    assert answer["staleness"]["sweptGroups"] == 1
    every = asyncio.run(sched.batch("math-demo", 1, include_all=True))
    assert every["counted"] == 0 and {g["prompt"]: g["state"] for g in every["groups"]}[0] == "cancelled"
    assert len(every["groups"]) == 3  # refilled with a fresh group


def test_a_batch_that_keeps_losing_groups_to_infrastructure_fails_instead_of_looping(tmp_path, store_location):
    store, sched, node = make(tmp_path, store_location, target=1, in_flight=2)
    sched.request_batch("math-demo")
    for _ in range(60):
        leases = lease_all(sched, node)
        if not leases:
            break
        report(sched, node, leases, mixed_every_third, infra=set(range(1000)))
    every = asyncio.run(sched.batch("math-demo", 1, include_all=True))
    assert every["state"] == "failed"
    prog = asyncio.run(sched.progress(store.get("math-demo")))
    assert prog.failed and "infrastructure" in prog.failed
    delivered = [json.loads(d) for _, d in sched.work.feed.trajectories("math-demo")]
    assert delivered and all(t["reward"] is None and t["failure"]["kind"] == "infra" for t in delivered)
    assert all(t["group"] is not None for t in delivered)


def test_named_prompts_run_exactly_those_groups_and_an_infra_failure_is_not_replaced(tmp_path, store_location):
    """A trainer that picks its prompts (TRL) gets exactly those groups, in its order; a group lost
    to infrastructure stays in the batch as incomplete (never replaced by another prompt, never 0)."""
    store, sched, node = make(tmp_path, store_location, dapo=False, batches={"groups": 2})
    info = sched.request_batch("math-demo", prompts=[7, 3, 7])
    assert info["target"] == 3 and info["prompts"] == [7, 3, 7]
    assert sched.request_batch("math-demo", prompts=[7, 3, 7])["batch"] == 1  # idempotent
    with pytest.raises(Conflict):
        sched.request_batch("math-demo", prompts=[1, 2, 3])
    for _ in range(5):  # prompt 3 fails until its attempts are used up
        leases = lease_all(sched, node)
        if not leases:
            break
        assert {l.prompt for l in leases} <= {7, 3}
        report(sched, node, leases, lambda p, s: float(s % 2), infra={3})
    snap = asyncio.run(sched.batch("math-demo", 1, include_all=True))
    assert snap["state"] == "complete" and snap["counted"] == 2
    assert [(g["prompt"], g["state"]) for g in snap["groups"]] == [(7, "counted"), (3, "incomplete"), (7, "counted")]
    assert all(t["reward"] is None for t in snap["groups"][1]["samples"])
    assert sched.request_batch("math-demo")["batch"] == 2  # the next batch (cursor order) still works


def test_named_prompts_are_checked(tmp_path, store_location, new_store_location):
    _, sched, _ = make(tmp_path, store_location, prompts=5, dapo=False, batches={"groups": 2})
    for bad in ([], [5], [-1]):
        with pytest.raises(BadRequest):
            sched.request_batch("math-demo", prompts=bad)
    (tmp_path / "dapo").mkdir()
    _, dapo_sched, _ = make(tmp_path / "dapo", new_store_location(), dapo=True)
    with pytest.raises(BadRequest, match="DAPO"):
        dapo_sched.request_batch("math-demo", prompts=[0])


def test_the_capacity_gate_opens_no_more_than_the_bound_allows(tmp_path, store_location):
    # DAPO would run 4 groups at once; with maxStaleness 0 and no version announced, (0 + 0 + 1) x 1 group at most
    store, sched, node = make(tmp_path, store_location, target=1, in_flight=4, max_staleness=0)
    sched.request_batch("math-demo")
    every = asyncio.run(sched.batch("math-demo", 1, include_all=True))
    assert every["openedGroups"] == 1
    assert sched.policy("math-demo")["staleness"]["gated"] == 3
    asyncio.run(sched.announce_policy("math-demo", 1, pause=False))  # one version more: room for one group more
    assert asyncio.run(sched.batch("math-demo", 1, include_all=True))["openedGroups"] == 2


def test_an_infrastructure_failure_in_a_group_re_runs_that_sample_only(tmp_path, store_location):
    store, sched, node = make(tmp_path, store_location, dapo=False, batches={"groups": 1})
    sched.request_batch("math-demo")
    leases = lease_all(sched, node)
    assert sorted(l.sample for l in leases) == [0, 1, 2, 3]
    bad = [l for l in leases if l.sample == 2]
    good = [l for l in leases if l.sample != 2]
    report(sched, node, good, lambda p, s: float(s % 2))
    sched.work.calls.results(node, ResultBatch(results=[Result(attempt_id=bad[0].attempt_id, trajectory=Trajectory(
        job="x", prompt=0, sample=0, failure=Failure(kind="infra", reason="sandbox died")))]))
    again = lease_all(sched, node)
    assert [(l.prompt, l.sample) for l in again] == [(bad[0].prompt, 2)]  # that sample, not the group
    assert asyncio.run(sched.batch("math-demo", 1))["counted"] == 0       # the group waits for it
    report(sched, node, again, lambda p, s: 1.0)
    snap = asyncio.run(sched.batch("math-demo", 1))
    assert snap["counted"] == 1 and len(snap["groups"][0]["samples"]) == 4


def test_a_backend_that_fails_to_load_is_reported_and_the_daemons_keep_its_old_version(tmp_path, store_location):
    store, sched, node = make(tmp_path, store_location, dapo=False, batches={"groups": 1})
    job = store.get("math-demo")
    job.spec.policy.update_mode = "keep"
    store.apply(job)
    # http://a answers nothing: its pause and reload fail; no daemon beats, so the fence is not waited for long
    answer = asyncio.run(sched.announce_policy("math-demo", 1, weights_path="/nonexistent", drain_timeout=0.3))
    assert answer["mode"] == "keep" and answer["version"] == 1 and answer["drained"] is False
    [b] = answer["backends"]
    assert b["url"] == "http://a" and b["error"] and b["reloaded"] is False
    hb = sched.work.calls.heartbeat(node, Heartbeat())
    assert hb.policy_version == 1 and hb.llm_paused is False
    assert hb.backend_versions == {"http://a": None} and hb.llm_fence == 1


def test_a_batch_opening_in_a_thread_and_results_settling_its_groups_never_over_open(tmp_path, store_location):
    """Issue 36: a large batch opens in a worker thread (`Scheduler._fill_step`, a step at a time) while results
    settle its groups and replenish it on another thread. Both take the batch's write lock, then `Batches.lock`:
    neither waits for the other forever, and the batch opens exactly its groups (two writers reading the same
    counts would open more)."""
    import threading

    store, sched, node = make(tmp_path, store_location, prompts=400, samples=2, dapo=False, target=120, in_flight=120)
    sched.request_batch("math-demo")  # its first step, as the route's
    job = sched.work.jobs.get("math-demo")
    errors: list[BaseException] = []

    def fill() -> None:
        try:
            while sched._fill_step(job, 1):
                pass
        except BaseException as e:  # noqa: BLE001 - the assertion below names it
            errors.append(e)

    opener = threading.Thread(target=fill)
    opener.start()
    while opener.is_alive():
        leases = lease_all(sched, node)
        if leases:
            report(sched, node, leases, lambda p, s: 1.0)
    opener.join(60)
    assert not opener.is_alive() and not errors, errors
    while leases := lease_all(sched, node):
        report(sched, node, leases, lambda p, s: 1.0)
    snap = asyncio.run(sched.batch("math-demo", 1))
    assert snap["state"] == "complete" and snap["counted"] == 120 and snap["openedGroups"] == 120, \
        {k: v for k, v in snap.items() if k != "groups"}
    assert len(snap["groups"]) == 120


def test_a_reload_on_a_shared_backend_tags_the_other_jobs_tokens_with_the_weights_it_runs(tmp_path, store_location,
                                                                                           monkeypatch):
    """Two jobs on one backend, each with its own policy: job A's reload puts A's weights there, so what the backend
    generates for job B from then on is tagged `A@version` (not in B's history: too old for any staleness bound),
    until B's own reload; a job on another backend is not touched."""
    store, sched, node = make(tmp_path, store_location, dapo=False, batches={"groups": 1})
    for name, url in (("eval", "http://a"), ("elsewhere", "http://b")):
        doc = store.get("math-demo").wire()
        doc["metadata"] = {"name": name}
        doc["spec"]["llm"]["backends"] = [{"url": url}]
        store.apply(RolloutJob.model_validate(doc))
        sched.work.jobs.get(name)

    labels = []

    async def loaded(url, weights_path, pause, label=None):
        labels.append(read_label(label))
        return {"url": url, "reloaded": True, "error": None, "reloadSeconds": 0.1}
    monkeypatch.setattr(sched.work.policies.http, "update", loaded)
    a = store.get("math-demo").metadata.key
    asyncio.run(sched.announce_policy("math-demo", 1, weights_path="/w", pause=False))
    assert labels == [(a, store.get("math-demo").metadata.uid, 1)]  # the engine stamps its tokens with A's weights
    nodes = {n: sched.work.registry.register(RegisterRequest(job=n, protocol=NODE_PROTOCOL, name=f"n-{n}")).node_id
             for n in ("eval", "elsewhere")}
    beat = {n: sched.work.calls.heartbeat(nid, Heartbeat()) for n, nid in nodes.items()}
    assert beat["eval"].backend_versions == {"http://a": f"{a}@1"} and beat["eval"].policy_version is None
    assert beat["elsewhere"].backend_versions == {}
    assert sched.work.calls.heartbeat(node, Heartbeat()).backend_versions == {}  # A's own: runs A's version
    asyncio.run(sched.announce_policy("eval", 5, weights_path="/w", pause=False))  # B loads its own weights again
    assert sched.work.calls.heartbeat(nodes["eval"], Heartbeat()).backend_versions == {}
    assert sched.work.calls.heartbeat(node, Heartbeat()).backend_versions == {"http://a": f"{store.get('eval').metadata.key}@5"}
    # a turn of B's own current version beside one of A's weights is as stale as it gets for B's bound
    from rolloutd.controller.work.staleness import staleness
    mixed = Trajectory(job="x", prompt=0, sample=0, policy_version=5, policy_versions=[5, f"{a}@1"])
    assert staleness(mixed, [5]) == 1 and staleness(mixed.model_copy(update={"policy_versions": [5]}), [5]) == 0
