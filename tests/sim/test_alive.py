"""`support.sim.alive`, the one check of a process's /proc state that tests/ and the local Slurm cluster use: a
running child is alive; one that has exited but is not yet reaped (a zombie) is not; a pid no process has is not."""
from __future__ import annotations

import os
import signal
import subprocess

from support.sim import alive


def test_a_running_child_is_alive_and_its_zombie_is_not():
    child = subprocess.Popen(["sleep", "300"])
    try:
        assert alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, left unreaped: a zombie
        assert not alive(child.pid)
    finally:
        child.kill()
        child.wait()
    assert not alive(2**22 + 1)  # above the largest pid Linux hands out (pid_max ≤ 2**22)
