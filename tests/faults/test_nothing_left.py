"""A daemon that leaves with rollouts in flight leaves nothing on the host — no sandbox process, no bounded-workspace
tmpfs mount, no sandbox directory — whether it gives its controller up (LOST) or the tests' teardown SIGKILLs it.

Real controller, real daemons, real bwrap (gated oracle rollouts held in INIT, their workspaces mounted). For the
give-up, the daemons' limit is shortened for this test only by a `sitecustomize` on their PYTHONPATH (the product's
default, 20 × leaseSeconds + 60 s, is untouched)."""
from __future__ import annotations

from pathlib import Path

from support.cluster import Cluster, held_at_gate
from support.fault_jobs import gated_oracle_job
from support.waiting import alive, wait_until

from rolloutd.sandbox.host.footprint import pids_with_id

ROLLOUTS = 4
SHORT_LIMIT = '''import os
if os.environ.get("ROLLOUTD_TEST_GIVE_UP_LEASES"):
    import rolloutd.agents.daemon.heartbeat as heartbeat
    heartbeat.UNREACHABLE_LEASES = int(os.environ["ROLLOUTD_TEST_GIVE_UP_LEASES"])
'''


def _mounts_under(base: Path) -> list[str]:
    with open("/proc/self/mounts") as f:
        return [p for p in (line.split()[1].replace("\\040", " ") for line in f) if p.startswith(f"{base}/")]


def _held(cluster: Cluster, tmp_path: Path, name: str) -> tuple[list[str], list[int]]:
    """The job's rollouts held at INIT's gate: the sandbox ids (their workspaces mounted) and the daemons' pids."""
    base = tmp_path / "sandboxes"
    cluster.apply(gated_oracle_job(name, tmp_path / "gate", rollouts=ROLLOUTS))
    wait_until(lambda: held_at_gate(cluster, name) == ROLLOUTS, 120, "every rollout held at INIT's gate", every=0.1)
    sandboxes = [p.name for p in base.iterdir()]
    assert len(_mounts_under(base)) >= ROLLOUTS, "the held rollouts' workspaces are mounted"
    return sandboxes, cluster.daemon_pids()


def _nothing_left(base: Path, sandboxes: list[str]) -> None:
    assert _mounts_under(base) == [], "a workspace left mounted"
    assert {s: pids_with_id(s) for s in sandboxes if pids_with_id(s)} == {}, "a sandbox process left"
    assert list(base.iterdir()) == [], "a sandbox directory left"


def test_a_daemon_that_gives_its_controller_up_leaves_no_mount_and_no_process(cluster, tmp_path):
    seam = tmp_path / "seam"
    seam.mkdir()
    (seam / "sitecustomize.py").write_text(SHORT_LIMIT)
    cluster.stop()  # the fixture's controller was started without the seam: again, with it
    cluster.env = {**cluster.env, "ROLLOUTD_TEST_GIVE_UP_LEASES": "2", "ROLLOUTD_CONTROLLER_START_SECONDS": "0",
                   "PYTHONPATH": f"{seam}:{cluster.env.get('PYTHONPATH', '')}"}
    cluster.start()
    sandboxes, pids = _held(cluster, tmp_path, "lost")
    cluster.kill()  # for good: the daemons give it up (LOST) with every rollout in flight, and exit on their own
    wait_until(lambda: not any(alive(p) for p in pids), 120, "the daemons to give the controller up", every=0.1)
    assert "the controller has not answered for" in "".join(
        p.read_text(errors="replace") for p in cluster.data_dir.rglob("*.log"))
    _nothing_left(tmp_path / "sandboxes", sandboxes)


def test_the_teardown_that_kills_daemons_mid_rollout_leaves_no_mount_and_no_process(cluster, tmp_path):
    """A failed test's teardown SIGKILLs its daemons mid-rollout: their sandboxes die with them, their workspace
    mounts do not (before: left mounted on the host for good, no next daemon on that per-test dir to sweep them)."""
    sandboxes, pids = _held(cluster, tmp_path, "held")
    cluster.stop()
    wait_until(lambda: not any(alive(p) for p in pids), 30, "the killed daemons to be gone", every=0.05)
    _nothing_left(tmp_path / "sandboxes", sandboxes)
