"""A keep or abort update's last steps, in order (`PolicyVersions._live`): once every engine has loaded the new version
(still paused), it is committed; the engines resume while that commit is synced; the daemons are told once both are
done, and so is the trainer. A result tagged with the new version is acknowledged only after a sync that started after
the row's commit."""
from __future__ import annotations

import asyncio
import json
import time

import pytest
from sqlmodel import Session

from rolloutd.controller.work.backend_http import BackendHttp
from rolloutd.controller.work.tables import PolicyRow

from .test_batches import make


class Engines(BackendHttp):
    """Backends that answer at once, each call logged with the job's policy row as the store holds it then."""

    def __init__(self, read_row, log: list) -> None:
        super().__init__()
        self.read_row, self.log, self.asked = read_row, log, []

    async def post(self, url, path, params=None):
        self.log.append((path, url, self.read_row()))
        self.asked.append((path, params))
        await asyncio.sleep(0.05)  # a slow engine: the commit and its sync go on meanwhile
        self.log.append((path + " done", url, self.read_row()))
        return None

    async def load(self, url, weights_path, *, running, label=None, reset=True):
        self.log.append(("load", url, self.read_row()))
        self.asked.append(("load", {"running": running, "reset": reset}))
        return {"url": url, "reloaded": True, "error": None, "reloadSeconds": 0.0}


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_the_version_is_committed_on_loaded_engines_and_synced_while_they_resume(tmp_path, store_location,
                                                                                         mode):
    store, sched, node = make(tmp_path, store_location, dapo=False, batches={"groups": 1})
    job = store.get("math-demo")
    job.spec.policy.update_mode = mode
    job.spec.llm.backends = [type(job.spec.llm.backends[0])(url=u) for u in ("http://a", "http://b")]
    store.apply(job)
    policies = sched.work.policies

    def read_row():  # the row as stored, and whether the daemons were told of a change since (the policy's epoch)
        with Session(policies.engine) as s:
            row = s.get(PolicyRow, "math-demo")
            return None if row is None else (json.loads(row.version), row.paused, policies._epoch["math-demo"])
    log: list = []
    policies.http = Engines(read_row, log)

    async def settle():
        log.append(("sync", None, read_row()))
        await asyncio.sleep(0.02)
        log.append(("synced", None, read_row()))
    policies.settle = settle
    answer = asyncio.run(sched.announce_policy("math-demo", 1, weights_path="/w", drain_timeout=0.3))
    assert answer["version"] == 1 and not any(b["error"] for b in answer["backends"])
    steps = [(what, url) for what, url, _ in log]
    at = lambda what: [i for i, (w, _) in enumerate(steps) if w == what]  # noqa: E731
    resumes, resumed, loads = at("/resume"), at("/resume done"), at("load")
    sync, synced = steps.index(("sync", None)), steps.index(("synced", None))
    assert len(resumes) == len(resumed) == len(loads) == 2
    # loaded; committed; then the resumes asked and the commit synced at once; the answer after both
    assert max(loads) < sync < min(resumed) and max(resumes) < synced
    rows = {what: row for what, _, row in log}
    told = rows["load"][2]  # the daemons were last told at the hold (the row paused, the old version)
    assert rows["load"] == (None, True, told)
    # committed before the resumes and the sync, but the daemons told only once the engines resumed
    assert all(row == (1, False, told) for what, _, row in log if what in ("/resume", "/resume done", "sync", "synced"))
    assert policies._epoch["math-demo"] > told and read_row() == (1, False, policies._epoch["math-demo"])
    # abort: the pause clears the prefix cache and nothing runs until the resume, so the load resets nothing again;
    # keep: the kept requests' KV is reset after the load
    asked = policies.http.asked
    if mode == "abort":
        assert ("/pause", {"mode": "abort", "clear_cache": "true"}) in asked
        assert ("load", {"running": False, "reset": False}) in asked
    else:
        assert ("/pause", {"mode": "keep"}) in asked and ("load", {"running": True, "reset": True}) in asked
    s = answer["steps"]
    assert s["loaded"] <= s["committed"] <= min(s["resumed"], s["synced"]) <= answer["pausedSeconds"]


def test_a_result_acknowledged_after_the_commit_waits_for_a_sync_that_started_after_it(tmp_path):
    """Why resuming before the sync tags no durable token with a version that is not durable: a result tagged with the
    new version is committed after the row and acknowledged after `Durable.settle`, whose sync starts after that
    call (the WAL syncs in order: the row's commit with it). Here on the real store's `Durable`."""
    store, sched, node = make(tmp_path, tmp_path / "store.db", dapo=False, batches={"groups": 1})
    durable = store.durable
    syncs: list[float] = []
    real = durable.sync_now

    def sync_now():
        syncs.append(time.monotonic())
        real()
    durable.sync_now = sync_now
    sched.work.policies._commit("math-demo", 1, None, [])
    committed = time.monotonic()

    async def both():  # the announce's own sync and a result's acknowledgement, racing
        await asyncio.gather(durable.settle(), durable.settle())
    asyncio.run(both())
    assert syncs and all(t > committed for t in syncs)
    assert durable.settled == 2 and durable.syncs >= 1


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_an_update_does_not_wait_for_the_daemons_of_a_released_job(tmp_path, store_location, mode):
    """A job that finished as its update came: the reconciler stopped its daemons and revoked their credential, so none
    could deregister or beat. The update waits for none of them (it waited a whole node timeout, ~60 s, for a daemon
    that had been stopped: tests/e2e/test_async_updates.py, 2026-11-30)."""
    store, sched, node = make(tmp_path, store_location, dapo=False, batches={"groups": 1})
    job = store.get("math-demo")
    job.spec.policy.update_mode = mode
    store.apply(job)
    policies = sched.work.policies
    policies.http = Engines(lambda: None, [])
    assert sched.work.registry.active("math-demo") == [node]
    asyncio.run(sched.released(job))
    assert sched.work.registry.active("math-demo") == []
    answer = asyncio.run(sched.announce_policy("math-demo", 1, weights_path="/w", drain_timeout=5))
    assert answer["drained"] is True and answer["version"] == 1
