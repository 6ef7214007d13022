"""The reconcile's phase machine as the kopf handlers drive it (`operator.handlers.Reconciler`), with a
scripted executor and work tracker over a store (logic only; kopf itself runs in the e2e and kube tests)."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from rolloutd.controller.errors import NotFound
from rolloutd.controller.executors.base import ExecutorError, NodeState
from rolloutd.controller.ports import Progress
from rolloutd.controller.operator import handlers
from rolloutd.controller.operator.handlers import Reconciler
from rolloutd.controller.store import Store
from rolloutd.crds.job_status import StageCounts
from rolloutd.crds.rolloutjob import RolloutJob
from support.store_api import StoreApi, reconcile_all

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "math-demo.yaml"


class ScriptedExecutor:
    def __init__(self):
        self.nodes: list[NodeState] = []
        self.ensured: list[int] = []
        self.released = 0
        self.error: ExecutorError | None = None

    async def ensure(self, job, nodes):
        if self.error:
            raise self.error
        self.ensured.append(nodes)

    async def observe(self, job):
        return list(self.nodes)

    async def release(self, job):
        self.released += 1


class ScriptedWork:
    def __init__(self):
        self.progress_value = Progress(StageCounts(total=8, queued=8))
        self.forgotten = self.released_times = 0

    async def admit(self, job):
        return None

    async def progress(self, job):
        return self.progress_value

    async def registered(self, job):
        return len([n for n in self.executor.nodes if n.state == "running"])

    async def released(self, job):
        self.released_times += 1

    async def forget(self, job):
        self.forgotten += 1


@pytest.fixture
def setup(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    ex, work = ScriptedExecutor(), ScriptedWork()
    work.executor = ex
    job = RolloutJob.model_validate(yaml.safe_load(EXAMPLE.read_text()))
    store.apply(job)
    return store, ex, work, Reconciler(StoreApi(store), {"local": ex}, work)


def phase(store):
    return store.get("math-demo").status.phase.value


def test_phases_to_success(setup):
    store, ex, work, rec = setup

    async def go():
        await reconcile_all(rec)
        assert phase(store) == "Provisioning" and ex.ensured == [2]
        assert store.get("math-demo").status.condition("Provisioned").status == "False"
        ex.nodes = [NodeState("n1", "running")]
        await reconcile_all(rec)
        st = store.get("math-demo").status
        assert st.phase.value == "Running" and st.nodes == 1 and st.start_time is not None
        work.progress_value = Progress(StageCounts(total=8, succeeded=8), done=True)
        await reconcile_all(rec)
        st = store.get("math-demo").status
        assert st.phase.value == "Succeeded" and st.condition("Complete").status == "True"
        assert st.completion_time is not None and ex.released == 1
        rv = store.get("math-demo").metadata.resource_version
        await reconcile_all(rec)  # idempotent: nothing changes on a finished job
        assert store.get("math-demo").metadata.resource_version == rv
        reasons = [e["reason"] for e in store.events("math-demo")]
        assert reasons == ["Provisioning", "Running", "Succeeded"]

    asyncio.run(go())


def test_permanent_executor_error_fails_with_message(setup):
    store, ex, work, rec = setup
    ex.error = ExecutorError("sbatch: error: invalid partition specified: nope", reason="InvalidPartition", permanent=True)
    asyncio.run(reconcile_all(rec))
    st = store.get("math-demo").status
    assert st.phase.value == "Failed"
    assert st.condition("Failed").reason == "InvalidPartition"
    assert "invalid partition" in st.condition("Failed").message


def test_transient_executor_error_is_retried(setup):
    store, ex, work, rec = setup
    ex.error = ExecutorError("slurmctld not responding", reason="SlurmUnavailable")
    asyncio.run(reconcile_all(rec))
    assert phase(store) == "Pending"
    assert store.get("math-demo").status.condition("Provisioned").reason == "SlurmUnavailable"
    ex.error = None
    asyncio.run(reconcile_all(rec))
    assert phase(store) == "Provisioning"


def test_delete_releases_and_removes(setup):
    store, ex, work, rec = setup
    asyncio.run(reconcile_all(rec))
    store.mark_deleted("math-demo")
    assert phase(store) == "Cancelling"
    asyncio.run(reconcile_all(rec))
    with pytest.raises(NotFound):
        store.get("math-demo")
    assert ex.released == 1 and work.forgotten == 1
    kinds = [(c.type, c.object["status"]["phase"]) for c in store.changes_since(0)][-2:]
    assert kinds == [("MODIFIED", "Cancelled"), ("DELETED", "Cancelled")]


def test_missing_executor_is_a_condition_not_a_crash(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    store.apply(RolloutJob.model_validate(yaml.safe_load(EXAMPLE.read_text())))
    asyncio.run(reconcile_all(Reconciler(StoreApi(store), {})))
    cond = store.get("math-demo").status.condition("ExecutorReady")
    assert cond.status == "False" and cond.reason == "ExecutorUnavailable"


def test_the_handlers_first_pass_uses_kopfs_body_and_a_stale_one_changes_nothing(setup):
    """ensure (create/update/resume) works on the object kopf's event carried, without reading it again; when
    that copy is stale (another pass wrote first), its status write is refused (409) and nothing regresses."""
    store, ex, work, rec = setup
    reads = []
    get = rec.api.get

    async def counted_get(namespace, name):
        reads.append(name)
        return await get(namespace, name)
    rec.api.get = counted_get
    body = store.get("math-demo").wire()  # what kopf hands the create handler

    async def go():
        await handlers.ensure(name="math-demo", namespace="default", memo=rec, body=body)
        assert reads == [] and phase(store) == "Provisioning" and ex.ensured == [2]
        ex.nodes = [NodeState("n1", "running")]
        await rec.step("default", "math-demo")  # the observing daemon: Running
        assert phase(store) == "Running"
        events = len(store.events("math-demo"))
        await handlers.ensure(name="math-demo", namespace="default", memo=rec, body=body)  # the stale copy
        assert phase(store) == "Running" and len(store.events("math-demo")) == events

    asyncio.run(go())
