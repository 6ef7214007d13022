"""Every key is (namespace, name): a hostile team-a, holding a namespace token, against a real controller.

Events, the old unnamespaced paths, admission caps and fair-share weights, the in-memory backends of a job
deleted and created again, token files narrowed in place; and the expansion of a big job, which runs in
bounded steps and stops at the item quota of the job's policy (QuotaExceeded).
"""
from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import tempfile
from pathlib import Path

import pytest
from support.example_job import example_doc
from support import controller_process as _fixtures
from support.waiting import wait_until

from rolloutd.controller.access.auth import create_scoped_token
from rolloutd.controller.operator.reconcile import reconcile
from rolloutd.controller.store import Store
from rolloutd.controller.access.tenancy import Policies
from rolloutd.controller.work.core import build_work
from rolloutd.controller.work.scheduler import Scheduler
from rolloutd.crds.node import NODE_PROTOCOL, RegisterRequest
from rolloutd.crds.rolloutjob import RolloutJob
from rolloutd.crds.tenancy import ADMITTED_BY, TenantPolicySpec, TenantQuotas

TESTS = Path(__file__).resolve().parents[1]
P = "/apis/rolloutd.io/v1alpha1"


def dataset(directory: Path, name: str, prompts: int) -> Path:
    path = directory / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "question": f"{i}+1?", "answer": str(i + 1)}) + "\n"
                            for i in range(prompts)))
    return path


def job_doc(name: str, namespace: str | None = None, *, source: Path | None = None, samples: int = 1,
            backends: tuple[str, ...] = ("http://127.0.0.1:8000",), cap: int | None = None,
            priority: int = 1) -> dict:
    doc = example_doc()  # its paths absolute, as the API wants them
    doc["metadata"] = {"name": name, **({"namespace": namespace} if namespace else {})}
    if source is not None:
        doc["spec"]["tasks"] = {"kind": "math", "source": str(source)}
    doc["spec"]["samplesPerPrompt"] = samples
    doc["spec"]["priority"] = priority
    doc["spec"]["llm"]["backends"] = [{"url": u} for u in backends]
    if cap is not None:
        doc["spec"]["llm"]["maxEpisodesPerBackend"] = cap
    doc["spec"]["executor"]["nodes"] = 1
    return doc


@pytest.fixture
def controller(tmp_path):
    c = _fixtures.ControllerProcess(tmp_path / "data").start()
    yield c
    c.stop()


def _ok(r, code: int = 200) -> dict:
    assert r.status_code == code, r.text
    return r.json()


# ---------------------------------------------------------------- events and the old paths (real controller)

def test_an_event_posted_in_team_a_lands_on_team_a_job_not_on_defaults(controller):
    team = create_scoped_token(controller.data_dir / "tokens", "team-a", read_only=False, namespaces=["team-a"])
    with controller.client() as admin, controller.client(team.token) as a:
        for ns in ("default", "team-a"):
            _ok(admin.post(f"{P}/namespaces/{ns}/rolloutjobs", json=job_doc("train")), 201)
        event = {"apiVersion": "v1", "kind": "Event", "type": "Warning", "reason": "Forged",
                 "message": "written by team-a",
                 "involvedObject": {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "name": "train",
                                    "namespace": "team-a"}}
        posted = _ok(a.post("/api/v1/namespaces/team-a/events", json=event), 201)  # was a 500
        assert posted["involvedObject"]["namespace"] == "team-a" and posted["reason"] == "Forged"
        mine = _ok(a.get(f"{P}/namespaces/team-a/rolloutjobs/train/events"))["items"]
        assert [e["reason"] for e in mine].count("Forged") == 1
        theirs = _ok(admin.get(f"{P}/namespaces/default/rolloutjobs/train/events"))["items"]
        assert all(e["reason"] != "Forged" for e in theirs), theirs
        listed = _ok(admin.get("/api/v1/namespaces/default/events"))["items"]
        assert all(e["reason"] != "Forged" for e in listed)


def test_the_operators_own_events_of_a_team_a_job_land_on_it(tmp_path):
    """The embedded operator posts its events through the API, in the job's namespace: with the local executor
    (asked for no node, so nothing starts) each job gets its own Provisioning event, none lands on default's."""
    c = _fixtures.ControllerProcess(tmp_path / "data", executors="local").start()
    data = dataset(tmp_path, "d", 2)
    try:
        with c.client() as admin:
            for ns in ("default", "team-a"):
                doc = job_doc("train", source=data)
                doc["spec"]["executor"]["nodes"] = 0
                _ok(admin.post(f"{P}/namespaces/{ns}/rolloutjobs", json=doc), 201)

            def reasons(ns: str) -> list[str]:
                return [e["reason"] for e in _ok(admin.get(f"{P}/namespaces/{ns}/rolloutjobs/train/events"))["items"]]

            wait_until(lambda: "Provisioning" in reasons("team-a") and "Provisioning" in reasons("default"),
                       timeout=60, what="each job's Provisioning event")
            assert reasons("default").count("Provisioning") == 1 and reasons("team-a").count("Provisioning") == 1
    finally:
        c.stop()


def test_an_old_path_put_naming_another_namespace_is_a_400_and_changes_nothing(controller):
    default = create_scoped_token(controller.data_dir / "tokens", "dflt", read_only=False, namespaces=["default"])
    with controller.client() as admin, controller.client(default.token) as d:
        before = _ok(admin.post(f"{P}/namespaces/team-b/rolloutjobs", json=job_doc("train")), 201)
        for ns in ("team-b", "team-new"):
            forged = job_doc("train", ns)
            forged["spec"]["priority"] = 9
            r = d.put(f"{P}/rolloutjobs/train", json=forged)
            assert r.status_code == 400, r.text
            assert "metadata.namespace" in r.text
        after = _ok(admin.get(f"{P}/namespaces/team-b/rolloutjobs/train"))
        assert after["metadata"]["generation"] == before["metadata"]["generation"]  # the operator writes status
        assert after["spec"] == before["spec"] and after["spec"]["priority"] == 1
        names = {n["metadata"]["name"] for n in _ok(admin.get("/api/v1/namespaces"))["items"]}
        assert "team-new" not in names
        assert _ok(admin.get(f"{P}/rolloutjobs"))["items"][0]["metadata"]["namespace"] == "team-b"
        # the old path stays the default namespace's: a tenant's write there is held to default's policy
        refused = d.put(f"{P}/rolloutjobs/own", json=job_doc("own"))
        assert refused.status_code == 403 and "namespace 'default'" in refused.text, refused.text
        _ok(admin.put(f"{P}/rolloutjobs/own", json=job_doc("own")), 201)
        assert _ok(admin.get(f"{P}/namespaces/default/rolloutjobs/own"))["metadata"]["namespace"] == "default"


def test_a_token_file_narrowed_in_place_loses_its_wider_scope_on_the_next_request(controller):
    tokens = controller.data_dir / "tokens"
    wide = create_scoped_token(tokens, "team", read_only=False, namespaces=["team-a", "team-b"])
    path = tokens / "team.json"
    with controller.client() as admin, controller.client(wide.token) as t:
        _ok(admin.post(f"{P}/namespaces/team-b/rolloutjobs", json=job_doc("train")), 201)
        _ok(t.get(f"{P}/namespaces/team-b/rolloutjobs/train"))
        stat, dir_stat = path.stat(), tokens.stat()
        narrowed = path.read_bytes().replace(b'"team-b"', b'"team-x"')  # same size
        with open(path, "r+b") as f:  # in place: the directory does not change
            f.write(narrowed)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the file's mtime set back
        os.utime(tokens, ns=(dir_stat.st_atime_ns, dir_stat.st_mtime_ns))
        assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
        r = t.get(f"{P}/namespaces/team-b/rolloutjobs/train")
        assert r.status_code == 403, r.text
        _ok(t.get(f"{P}/namespaces/team-a/rolloutjobs"))  # what it still holds


# ---------------------------------------------------------------- admission, fair share, backends (real scheduler)

URL = "http://127.0.0.1:8000"


def _sched(tmp_path: Path, **kw) -> tuple[Store, Scheduler]:
    store = Store(tmp_path / "db.sqlite")
    return store, Scheduler(build_work(store, **kw))


def _node(sched: Scheduler, key: str, name: str) -> str:
    return sched.work.registry.register(RegisterRequest(job=key, protocol=NODE_PROTOCOL, name=name)).node_id


def test_team_a_s_small_cap_limits_team_a_only_on_a_shared_backend(tmp_path):
    store, sched = _sched(tmp_path, max_episodes=16)
    data = dataset(tmp_path, "d", 32)
    store.apply(RolloutJob.model_validate(job_doc("train", "team-a", source=data, cap=1)))
    store.apply(RolloutJob.model_validate(job_doc("train", "team-b", source=data)))
    for key in ("team-a/train", "team-b/train"):
        sched.work.expansions.expand(store.get(key))
        sched.work.jobs.sync(store.get(key))
    assert len(asyncio.run(sched.work.attempts.lease(_node(sched, "team-a/train", "a1"), 8)).leases) == 1  # its own cap
    leases = asyncio.run(sched.work.attempts.lease(_node(sched, "team-b/train", "b1"), 8)).leases
    assert len(leases) == 8  # the backend still admits 16: team-a's 1 is not the backend's cap
    assert sched.work.pool.admission.backend_cap(URL) == 16


def test_team_a_train_sets_neither_the_cap_nor_the_weight_of_default_train(tmp_path):
    store, sched = _sched(tmp_path)
    data = dataset(tmp_path, "d", 16)
    store.apply(RolloutJob.model_validate(job_doc("train", source=data, cap=8, priority=1)))
    store.apply(RolloutJob.model_validate(job_doc("train", "team-a", source=data, cap=1, priority=7)))
    ours, theirs = store.get("train"), store.get("team-a/train")
    for job in (ours, theirs):
        sched.work.expansions.expand(job)
        sched.work.jobs.sync(job)
    admission = sched.work.pool.admission
    assert admission.cap(URL, "train") == 8
    assert (admission.weight("train"), admission.weight("team-a/train")) == (1, 7)
    leases = asyncio.run(sched.work.attempts.lease(_node(sched, "train", "n1"), 8)).leases
    assert len(leases) == 8 and {lease.backend for lease in leases} == {URL}  # team-a's cap of 1 is its own


def test_a_job_deleted_and_created_again_does_not_inherit_its_backends(tmp_path):
    store, sched = _sched(tmp_path)
    data = dataset(tmp_path, "d", 4)
    old_url, new_url = "http://127.0.0.1:8001", "http://127.0.0.1:8002"
    store.apply(RolloutJob.model_validate(job_doc("train", "team-a", source=data, backends=(old_url,))))
    old = store.get("team-a/train")
    sched.work.expansions.expand(old)
    (lease,) = asyncio.run(sched.work.attempts.lease(_node(sched, "team-a/train", "n1"), 1)).leases
    assert lease.backend == old_url
    store.mark_deleted("train", "team-a")  # what the operator does: release, then drop the finalizer
    asyncio.run(sched.forget(store.get("team-a/train")))
    store.remove("team-a/train")
    assert old_url not in sched.work.pool.known()  # no job lists it now: no longer probed
    store.apply(RolloutJob.model_validate(job_doc("train", "team-a", source=data, backends=(new_url,))))
    new = store.get("team-a/train")
    assert new.metadata.uid != old.metadata.uid and new.metadata.generation == old.metadata.generation
    sched.work.expansions.expand(new)
    leases = asyncio.run(sched.work.attempts.lease(_node(sched, "team-a/train", "n2"), 4)).leases
    assert leases and {x.backend for x in leases} == {new_url}


# ---------------------------------------------------------------- expansion: bounded steps, the item quota

class _Executor:
    """The executor port with nothing behind it: the reconcile's executor calls succeed and start nothing."""

    async def ensure(self, job, nodes):
        return None

    async def observe(self, job):
        return []

    async def release(self, job):
        return None


def _items(db: Path, key: str) -> int:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT count(*) FROM items WHERE job = ?", (key,)).fetchone()[0]


def test_a_big_job_expands_in_bounded_steps_while_other_calls_go_on(tmp_path):
    """The reconcile of a 1000 × 64 job: between two looks of another task on the same event loop (what
    serves team-b's GETs), at most a few thousand items are written, never the whole job at once."""
    store, sched = _sched(tmp_path)
    store.apply(RolloutJob.model_validate(job_doc("big", "team-a", source=dataset(tmp_path, "big", 1000),
                                                  samples=64)))
    job = store.get("team-a/big")
    seen: list[int] = []

    async def go():
        done = asyncio.Event()

        async def look():
            while not done.is_set():
                seen.append(_items(tmp_path / "db.sqlite", "team-a/big"))
                await asyncio.sleep(0)

        watcher = asyncio.create_task(look())
        await asyncio.sleep(0)
        step = await reconcile(job, _Executor(), sched)
        done.set()
        await watcher
        return step

    step = asyncio.run(go())
    seen.append(_items(tmp_path / "db.sqlite", "team-a/big"))
    assert seen[-1] == 64_000 and step.status.counts.total == 64_000
    steps = [b - a for a, b in zip(seen, seen[1:]) if b != a]
    assert len(steps) > 10 and max(steps) <= 4096, (len(steps), max(steps))


def test_the_item_quota_of_the_jobs_policy_fails_it_with_quota_exceeded(tmp_path):
    root = Path(tempfile.mkdtemp(prefix="rolloutd-quota-", dir="/tmp"))  # the tenant's reads are nobody's
    root.chmod(0o755)
    policy = TenantPolicySpec(quotas=TenantQuotas(items_per_job=100), data_roots=[str(root)])
    store = Store(tmp_path / "db.sqlite")
    policies = Policies(store)  # the namespace's stored TenantPolicy, as the admin puts it
    policies.put("team-a", policy, {})
    sched = Scheduler(build_work(store, policies=policies))
    data = dataset(root, "d", 64)
    data.chmod(0o644)
    for ns in ("team-a", "default"):
        job = RolloutJob.model_validate(job_doc("train", ns, source=data, samples=2))
        if ns == "team-a":  # written by the namespace's token: held to its policy (`Policies.effective`)
            job.metadata.annotations = {**job.metadata.annotations, ADMITTED_BY: "team"}
        store.apply(job)
    over = asyncio.run(reconcile(store.get("team-a/train"), _Executor(), sched)).status
    failed = over.condition("Failed")
    assert over.phase.value == "Failed" and failed is not None and failed.reason == "QuotaExceeded"
    assert "quotas.itemsPerJob (100)" in failed.message and 'TenantPolicy "team-a"' in failed.message
    assert _items(tmp_path / "db.sqlite", "team-a/train") == 0  # stopped before a single item
    admin = asyncio.run(reconcile(store.get("train"), _Executor(), sched)).status  # unrestricted: 128 items
    assert admin.phase.value != "Failed" and admin.counts.total == 128


def test_a_controller_restarted_mid_expansion_goes_on_where_it_stopped(tmp_path):
    store, sched = _sched(tmp_path)
    store.apply(RolloutJob.model_validate(job_doc("big", "team-a", source=dataset(tmp_path, "big", 300), samples=64)))
    job = store.get("team-a/big")
    sched.work.expansions.admit(job)  # the start: the dataset read, nothing queued yet
    row = sched.work.expansions.admit(job)  # one step
    assert 0 < _items(tmp_path / "db.sqlite", "team-a/big") < 300 * 64 and row.pending
    again = Scheduler(build_work(Store(tmp_path / "db.sqlite")))  # a new controller process on the same database
    done = asyncio.run(again.admit(job))
    assert done.pending == 0 and not done.error
    with sqlite3.connect(tmp_path / "db.sqlite") as c:
        rows = c.execute("SELECT prompt, sample FROM items WHERE job = ?", ("team-a/big",)).fetchall()
        tasks = c.execute("SELECT count(*) FROM tasks WHERE job = ?", ("team-a/big",)).fetchone()[0]
    assert len(rows) == len(set(rows)) == 300 * 64 and tasks == 300
