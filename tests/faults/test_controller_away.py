"""A controller that is away — stopped (SIGSTOP) or killed and restarted — while healthy nodes hold leases charges
none of their rollouts as infrastructure failures: with `maxAttempts: 1` every rollout is scored exactly once.

Real controller, real daemons, real bwrap (gated oracle rollouts, tests/faults/conftest.py). The rollouts wait at
INIT's gate during the fault, so the fault happens mid-job whatever the machine's speed."""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

from support.cluster import held_at_gate
from support.waiting import alive, wait_until
from support.fault_jobs import LEASE_SECONDS, gated_oracle_job, scored_once

from rolloutd.agents.daemon.heartbeat import OUTAGE_LEASES, UNREACHABLE_LEASES

ROLLOUTS = 6


def _released(cluster, pids: list[int]) -> None:
    """The finished job's daemons exit on their own (their sandboxes unmounted), before the fixture kills anything."""
    wait_until(lambda: not any(alive(p) for p in pids), 60, "the finished job's daemons to exit", every=0.1)


def _held(cluster, tmp_path, name: str):
    gate = tmp_path / "gate"
    cluster.apply(gated_oracle_job(name, gate, rollouts=ROLLOUTS))
    wait_until(lambda: held_at_gate(cluster, name) == ROLLOUTS, 120, "every rollout held at INIT's gate", every=0.1)
    return gate


def test_a_controller_stopped_for_three_leases_cancels_no_rollout(cluster, tmp_path):
    """SIGSTOP for 3 × leaseSeconds, then SIGCONT: the controller heard no beat because it was not running, so it
    gives the nodes a whole lease to beat before expiring anything (before: every lease expired at once)."""
    gate = _held(cluster, tmp_path, "stopped")
    pids = cluster.daemon_pids()
    os.killpg(cluster.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(3 * LEASE_SECONDS)  # the fault itself: the controller does not run
    finally:
        os.killpg(cluster.proc.pid, signal.SIGCONT)
    gate.touch()
    cluster.wait_done("stopped", 120)
    scored_once(cluster, "stopped", ROLLOUTS)
    _released(cluster, pids)
    assert "the controller stalled for" in (cluster.root / "controller.log").read_text()
    # each daemon said whose time the silence was: its beat sent in time, answered late
    for path in sorted((cluster.data_dir / "logs").glob("stopped-*.log")):
        late = re.findall(r"no beat answered for ([\d.]+) s .*sent ([\d.]+) s after the last answer, "
                          r"answered ([\d.]+) s", path.read_text())
        assert late and max(float(a) for _, _, a in late) > LEASE_SECONDS, (path.name, late)


@pytest.mark.parametrize("leases", [2, 10])
def test_a_controller_killed_and_restarted_after_an_outage_loses_no_rollout(cluster, tmp_path, leases):
    """kill -9, away for `leases` × leaseSeconds (up to OUTAGE_LEASES, 10: the outage the service promises to ride
    through; the daemons leave only after twice that plus the controller's start), restarted on the same data: the
    daemons kept their work and their finished results, and deliver every one once."""
    assert leases <= OUTAGE_LEASES < UNREACHABLE_LEASES
    name = f"away{leases}"
    gate = _held(cluster, tmp_path, name)
    pids = cluster.daemon_pids()
    cluster.kill()
    gate.touch()  # the rollouts finish while the controller is away: their results wait on the daemon
    time.sleep(leases * LEASE_SECONDS)  # the outage itself
    cluster.start()
    # the same daemons go on: the restarted controller adopted each and started none (not `daemon_pids() == pids`
    # now: their results were waiting, so the job may be done and its daemons gone before that call)
    log = (cluster.root / "controller.log").read_text()
    assert sorted(int(p) for p in re.findall(r"adopted node daemon pid (\d+)", log)) == sorted(pids)
    assert len(re.findall(r"started node daemon pid", log)) == len(pids)
    cluster.wait_done(name, 120)
    scored_once(cluster, name, ROLLOUTS)
    _released(cluster, pids)


def test_a_controller_slow_to_start_after_an_outage_loses_no_rollout(cluster, tmp_path):
    """kill -9, away 2 × leaseSeconds, then a restart that cannot answer for UNREACHABLE_LEASES × leaseSeconds more
    (its process held with SIGSTOP as it starts: the slow start of a loaded host, ~20 s for this controller at load
    22, made certain). The daemons heard nothing for longer than 20 × leaseSeconds — the limit they left at before
    (#37: 2 s leases, a 4 s or 16 s outage and a restart at load 30+) — but a controller that is only starting is
    not gone: they wait for its start too, keep their rollouts (before: cancelled at 20 × leaseSeconds, infra-failed)
    and deliver every result once."""
    gate = _held(cluster, tmp_path, "slow")
    pids = cluster.daemon_pids()
    cluster.kill()
    silent_from = time.monotonic()
    time.sleep(2 * LEASE_SECONDS)  # the outage itself (the rollouts still held: in flight all along)
    cluster.launch()
    os.killpg(cluster.proc.pid, signal.SIGSTOP)  # the start, stalled
    try:
        time.sleep(UNREACHABLE_LEASES * LEASE_SECONDS)
    finally:
        os.killpg(cluster.proc.pid, signal.SIGCONT)
    cluster.ready(120)
    assert time.monotonic() - silent_from > UNREACHABLE_LEASES * LEASE_SECONDS
    assert all(alive(p) for p in pids), "a daemon left a controller that was starting"
    assert cluster.daemon_pids() == pids
    gate.touch()
    cluster.wait_done("slow", 120)
    scored_once(cluster, "slow", ROLLOUTS)
    _released(cluster, pids)
