"""A node daemon starts through its own module (`python -m rolloutd.agents.daemon`), not through the
controller's `rolloutd` command: every executor's command line names it, and it runs without the controller."""
from __future__ import annotations

import subprocess
import sys

from rolloutd.controller.executors.base import daemon_argv
from rolloutd.controller.executors.slurm.script import batch_script


def test_the_executors_start_the_daemons_module():
    argv = daemon_argv("/usr/bin/python3", "--slot", "0")
    assert argv == ["/usr/bin/python3", "-m", "rolloutd.agents.daemon", "--slot", "0"]  # the local executor's
    assert "/usr/bin/python3 -m rolloutd.agents.daemon --restarts 5" in batch_script("j", "u", [], "/usr/bin/python3")


def test_the_module_runs_a_daemon_without_the_controller(tmp_path):
    """Without its environment it refuses (exit 2, naming the variable), having imported nothing of the
    controller: the daemon's module is its own entry point."""
    code = ("import runpy, sys; sys.argv = ['rolloutd-node']\n"
            "try:\n    runpy.run_module('rolloutd.agents.daemon', run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    print(e.code, sorted(m for m in sys.modules if m.startswith('rolloutd.controller')))")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == "2 []", out.stdout + out.stderr
    assert "ROLLOUTD_CONTROLLER" in out.stderr
