"""SIGTERM to a real `rolloutd node` subprocess (what Slurm sends first, and what the local
executor sends on scale-down): unstarted leases handed back, in-flight rollouts finish within the
grace period, the rest cancelled (sandboxes closed) and handed back, deregistered, exit 0.

The scripted handler reaches the subprocess as a plug-in: a dist-info with a `rolloutd.tasks`
entry point on PYTHONPATH, found by `get_handler` like any third-party task kind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from support.node_helpers import TOKEN, make_spec, scripted_plugin_path
from rolloutd.crds.trajectory import Trajectory

DRAIN = 3.0


def wait_file(path: Path, text: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{text!r} not in the daemon's log:\n{path.read_text()[-3000:]}")
        time.sleep(0.02)


def test_sigterm_returns_unstarted_drains_in_flight_exits_0(controller, sandbox_dir, tmp_path):
    fake = controller(make_spec(workers=(3, 3, 1)))
    finish_a, never = tmp_path / "finish-A", tmp_path / "never"
    fake.add({"id": "A", "run_file": str(finish_a)}, {"id": "C", "run_file": str(never)})
    env = {
        **os.environ,
        "PYTHONPATH": scripted_plugin_path(tmp_path),
        "ROLLOUTD_CONTROLLER": fake.url, "ROLLOUTD_JOB": fake.job, "ROLLOUTD_JOIN_TOKEN": TOKEN,
        "ROLLOUTD_DRAIN_SECONDS": str(DRAIN), "ROLLOUTD_SANDBOX_DIR": str(sandbox_dir),
        "SLURMD_NODENAME": "sn1", "SLURM_JOB_ID": "4242", "SLURM_NODEID": "1",
    }
    log_path = tmp_path / "node.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rolloutd.controller.main", "node", "--slot", "0"],
                                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        # A and C in RUN; the daemon's next long-poll is held open by the controller
        fake.wait_for(lambda: sorted(fake.stages().values()) == ["run", "run"], 60, "A and C in RUN")
        fake.hold_next_lease = True
        fake.wait_for(fake.lease_held.is_set, 10, "the next /lease held open")
        proc.send_signal(signal.SIGTERM)
        t_term = time.monotonic()
        wait_file(log_path, "SIGTERM: stop leasing", 10, proc)
        # the held long-poll now answers with a lease B: it arrives after SIGTERM, never starts
        fake.add({"id": "B"})
        fake.release_lease.set()
        fake.wait_for(lambda: any(lease.task["id"] == "B" for lease in fake.lease_log), 10, "B leased")
        b = fake.lease_of("B").attempt_id
        fake.wait_for(lambda: any(b in r.attempt_ids for r in fake.returns), 10, "B handed back")
        # A finishes within the grace period and is reported
        finish_a.touch()
        a = fake.lease_of("A").attempt_id
        fake.wait_for(lambda: a in fake.accepted, 10, "A's result")
        code = proc.wait(timeout=DRAIN + 20)
        elapsed = time.monotonic() - t_term
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = log_path.read_text()
    assert code == 0, out[-3000:]
    c = fake.lease_of("C").attempt_id
    # registration: Slurm identity from the environment, the token never on the command line
    reg = fake.registers[0]
    assert (reg.name, reg.slurm_job_id, reg.slurm_node_id, reg.slot, reg.pid) == ("sn1", "4242", 1, 0, proc.pid)
    assert TOKEN not in " ".join(proc.args)
    # A: reported once, normally; B: handed back unstarted; C: cancelled after the grace period
    assert fake.receipts[a] == 1 and Trajectory.model_validate(fake.accepted[a]).reward == 1.0
    assert Trajectory.model_validate(fake.accepted[a]).node == "sn1"
    assert b not in fake.receipts and c not in fake.receipts
    reasons = {aid: r.reason for r in fake.returns for aid in r.attempt_ids}
    assert "not started" in reasons[b] and "grace period" in reasons[c]
    assert elapsed >= DRAIN  # C was cancelled only once the grace period was over (no upper bound: speed)
    assert fake.deregistered == 1
    # C's sandbox (and every other) is closed
    assert list(sandbox_dir.iterdir()) == []
    assert "sn1" in out  # logs carry the node name


def test_a_sigterm_that_arrives_as_the_daemon_exits_does_not_kill_it(controller):
    """Slurm's scancel --signal=TERM can reach a daemon that has just finished on its own (the job
    was done): its exit code must stay 0, or srun fails the allocation for a clean exit."""
    fake = controller(make_spec())
    fake.register_conflict = 'rolloutjobs "demo" is Cancelling; it takes no more nodes'
    script = (
        "import asyncio, os, signal, sys\n"
        "from rolloutd.agents.daemon.daemon import NodeDaemon\n"
        "from rolloutd.agents.daemon.options import NodeOptions\n"
        f"opts = NodeOptions(controller={fake.url!r}, job={fake.job!r}, token={TOKEN!r}, name='late')\n"
        "code = asyncio.run(NodeDaemon(opts, install_signals=True).run())\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(fake.registers) == 1
