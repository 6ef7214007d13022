"""A job's first wave is leased no faster than the warm pool warms (`agents/daemon/firstwave.py`): a real controller
running a job on a real `rolloutd node` (local executor, real bwrap); the node daemon in-process against the fake
controller (the node API's scripted stand-in); and the cap itself on a stand-in pool. `PACE_SECONDS` is raised in
the in-process tests so that only the pool's own events can end the pacing: a node that stalled would hang until
the test's deadline instead of passing late."""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import re

import pytest

from support.controller_process import ControllerProcess
from support.node_helpers import make_spec
from support.waiting import wait_until
from support.sim.noop import NOOP, PLUGINS
from rolloutd.agents.daemon import firstwave
from rolloutd.agents.daemon.firstwave import FirstWave
from rolloutd.agents.daemon.rollouts import Phase, Rollouts
from rolloutd.crds.node import Lease
from rolloutd.crds.trajectory import Trajectory
from support.scripted_tasks import ScriptedTask
from .test_daemon import daemon


@pytest.fixture
def patient(monkeypatch):
    monkeypatch.setattr(firstwave, "PACE_SECONDS", 3600.0)


def _scored(fake, n: int) -> list[Trajectory]:
    got = [Trajectory.model_validate(wire) for wire in fake.accepted.values()]
    assert len(got) == n
    return got


P = "/apis/rolloutd.io/v1alpha1/rolloutjobs"


@pytest.fixture
def real_controller(tmp_path, sandbox_dir):
    """A real `rolloutd controller` with the local executor; its daemons find the bench-noop task kind (PYTHONPATH)
    and put their sandboxes under the `sandbox_dir` fixture's directory (ROLLOUTD_SANDBOX_DIR, inherited)."""
    path = os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")]))
    c = ControllerProcess(tmp_path / "data", executors="local", env={"PYTHONPATH": path})
    c.data_dir.mkdir()
    yield c.start()
    c.stop()


@pytest.mark.parametrize("warm", [2, 0])
def test_a_real_node_serves_its_first_wave_warm_or_all_cold_without_a_pool(real_controller, tmp_path, warm):
    """12 rollouts (bench-noop with the bash tool, so each INIT takes a sandbox; the oracle agent: no tokenizer to
    load, the node leases as soon as it is set up) on an INIT pool of 12. spec.sandbox.warm 2: every INIT gets a
    warm sandbox (today: ~all 12 cold at once); warm 0: all 12 cold, as before. The node logs what its pool served."""
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps({"id": f"r{i}"}) + "\n" for i in range(12)))
    name = f"wave{warm}"
    job = {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": name}, "spec": {
        "tasks": {"kind": NOOP, "source": str(source), "limit": 12}, "samplesPerPrompt": 1,
        "agent": {"kind": "oracle", "maxTurns": 1, "tools": ["bash"]},
        "executor": {"kind": "local", "nodes": 1}, "sandbox": {"warm": warm},
        "pipeline": {"workersPerNode": {"init": 12, "run": 12, "eval": 12}}}}
    with real_controller.client() as api:
        put = api.put(f"{P}/{name}", json=job)
        assert put.status_code in (200, 201), put.text
        wait_until(lambda: api.get(f"{P}/{name}").json().get("status", {}).get("phase") in ("Succeeded", "Failed"),
                   120, "the job to end")
        assert api.get(f"{P}/{name}").json()["status"]["phase"] == "Succeeded"
        got = [json.loads(line) for line in
               api.get(f"{P}/{name}/trajectories", params={"limit": 100}).text.splitlines()]
    assert len(got) == 12 and all(t["failure"]["kind"] == "none" and t["reward"] == 1.0 for t in got)
    logs = real_controller.data_dir / "logs"
    wait_until(lambda: "warm pool:" in "".join(f.read_text() for f in logs.glob(f"{name}-node*.log")), 60,
               "the node's exit")
    node_log = "".join(f.read_text() for f in logs.glob(f"{name}-node*.log"))
    served = re.search(r"warm pool: (\d+) sandboxes handed out warm, (\d+) created cold", node_log).groups()
    assert served == (("12", "0") if warm else ("0", "12")), node_log[-3000:]


def _run_wave(controller, tokenizer, n: int, sandbox: dict):
    """A job of `n` rollouts on INIT/RUN/EVAL pools of `n`, run to its end by an in-process daemon (real bwrap):
    the fake controller, the daemon, its exit code and the task handler."""
    fake = controller(make_spec(workers=(n, n, n), sandbox=sandbox))
    fake.add(*({"id": f"t{i}"} for i in range(n)))
    handler = ScriptedTask()

    async def scenario():
        d = daemon(fake, handler, tokenizer=tokenizer)
        return d, await asyncio.wait_for(d.run(), 120)   # a stalled node never gets here

    d, code = asyncio.run(scenario())
    return fake, d, code, handler


def test_a_first_wave_wider_than_the_warm_pool_gets_only_warm_sandboxes(controller, sandbox_dir, tokenizer, patient):
    """12 rollouts on an INIT pool of 12, spec.sandbox.warm 2, the tokenizer already loaded: the leases would come
    before the pool has warmed 12 (today: ~all cold at once). Paced, every INIT gets a warm sandbox."""
    fake, d, code, _ = _run_wave(controller, tokenizer, 12, {"warm": 2})
    assert code == 0
    assert all(t.failure.kind.value == "none" and t.reward is not None for t in _scored(fake, 12))
    assert (d.pipeline.pool.stats["warm"], d.pipeline.pool.stats["cold"]) == (12, 0)
    assert d.pipeline.first_wave.over                    # ended by the wave's width leased
    assert list(sandbox_dir.iterdir()) == []


def test_no_warm_pool_leases_the_whole_wave_at_once_all_cold(controller, sandbox_dir, tokenizer, patient):
    """spec.sandbox.warm 0 keeps today's behaviour: no pacing, every INIT creates its sandbox cold."""
    fake, d, code, _ = _run_wave(controller, tokenizer, 12, {"warm": 0})
    assert code == 0 and d.pipeline.first_wave is None
    assert all(t.failure.kind.value == "none" for t in _scored(fake, 12))
    # the wave leased in one call (or two); calls after it, while the wave ran, came back empty: how many depends on
    # how long its rollouts took (a long-poll ends empty after the daemon's lease wait)
    assert len(fake.lease_log) == 12 and fake.granting_lease_calls <= 2
    assert (d.pipeline.pool.stats["warm"], d.pipeline.pool.stats["cold"]) == (0, 12)   # a plain create each


def test_a_pool_whose_creations_fail_does_not_stall_the_node(controller, sandbox_dir, tokenizer, patient):
    """The sandbox image does not exist, so the pool never warms one (real bwrap runtime): its first failure ends
    the pacing, every INIT creates cold and fails, and all 6 rollouts come back as infra failures, none lost."""
    fake, d, code, handler = _run_wave(controller, tokenizer, 6, {"warm": 2, "image": "/nonexistent/rootfs"})
    assert code == 0 and handler.ran == []
    for t in _scored(fake, 6):
        assert t.failure.kind.value == "infra" and t.reward is None and "/nonexistent/rootfs" in t.failure.reason
    assert d.pipeline.pool.stats["failures"] >= 1 and d.pipeline.pool.stats["cold"] == 6
    assert list(sandbox_dir.iterdir()) == []


# ------------------------------------------------------------------------------------- the cap alone
class StandInPool:
    """What `FirstWave` reads of a `WarmPool`: idle, stats, closed."""

    def __init__(self) -> None:
        self.idle, self.closed = 0, False
        self.stats: collections.Counter[str] = collections.Counter()


def _rollouts() -> Rollouts:
    return Rollouts(logging.LoggerAdapter(logging.getLogger("test"), {}), collections.Counter(),
                    lambda **_: None, lambda aid: None)


def _lease(rollouts: Rollouts, i: int):
    async def idle(r):
        await asyncio.Event().wait()

    lease = Lease(attempt_id=f"a{i}", item=i, prompt=i, sample=0, attempt=1, task={"id": i}, backend=None)
    rollouts.start(lease, None, idle)
    return rollouts.live[lease.attempt_id]


def test_the_cap_is_the_idle_sandboxes_not_yet_promised_and_ends_with_the_wave():
    async def scenario():
        pool, rollouts, woken = StandInPool(), _rollouts(), []
        wave = FirstWave(pool, 3, rollouts, lambda: woken.append(1))
        assert wave.cap() == 0                             # nothing warm yet: lease nothing
        wave.sandbox_ready()                               # the pool's hook wakes the lease loop while pacing
        assert woken == [1]
        pool.idle = 2
        assert wave.cap() == 2
        a = _lease(rollouts, 0)                            # leased, no sandbox yet: one idle is promised to it
        assert wave.cap() == 1
        rollouts.set_phase(a, Phase.INIT)
        assert wave.cap() == 1
        pool.idle, a.sandbox = 1, object()                 # it took its sandbox
        assert wave.cap() == 1
        b, c = _lease(rollouts, 1), _lease(rollouts, 2)    # the wave's width (3) leased: normal room from now on
        assert wave.cap() is None and wave.over
        wave.sandbox_ready()                               # paced no more: the pool no longer wakes it
        assert woken == [1]
        for r in (a, b, c):
            r.task.cancel()

    asyncio.run(scenario())


@pytest.mark.parametrize("end", ["failure", "closed"])
def test_a_failed_creation_or_a_closed_pool_ends_the_pacing(end):
    async def scenario():
        pool, rollouts = StandInPool(), _rollouts()
        wave = FirstWave(pool, 8, rollouts, lambda: None)
        assert wave.cap() == 0
        if end == "failure":
            pool.stats["failures"] += 1
        else:
            pool.closed = True
        assert wave.cap() is None

    asyncio.run(scenario())


def test_the_bound_of_time_ends_the_pacing_and_wakes_the_lease_loop(monkeypatch):
    monkeypatch.setattr(firstwave, "PACE_SECONDS", 0.05)

    async def scenario():
        pool, rollouts, woken = StandInPool(), _rollouts(), asyncio.Event()
        wave = FirstWave(pool, 8, rollouts, woken.set)
        assert wave.cap() == 0                              # the clock starts with leasing
        await asyncio.wait_for(woken.wait(), 30)            # the timer woke the lease loop, no poll
        assert wave.cap() is None

    asyncio.run(scenario())
