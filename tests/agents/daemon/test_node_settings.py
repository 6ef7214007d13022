"""The node daemon's sandbox settings, against a real `rolloutd node` subprocess: read once as it starts (from
its environment) and handed to its sandbox runtime, so ROLLOUTD_SANDBOX_DIR decides where its sandboxes are made;
a bad value ends the start with a message naming the variable, not a traceback, before the daemon registers."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from support.node_helpers import TOKEN, make_spec, scripted_plugin_path
from support.waiting import wait_until

NODE = [sys.executable, "-m", "rolloutd.controller.main", "node", "--slot", "0"]


def _env(fake, **extra: str) -> dict[str, str]:
    return {**os.environ, "ROLLOUTD_CONTROLLER": fake.url, "ROLLOUTD_JOB": fake.job, "ROLLOUTD_JOIN_TOKEN": TOKEN,
            "SLURMD_NODENAME": "settings-node", **extra}


def test_the_sandbox_dir_set_at_start_is_where_the_daemon_makes_sandboxes(controller, sandbox_dir, tmp_path):
    chosen = tmp_path / "chosen-sandboxes"  # not the fixture's: only this daemon's environment names it
    fake = controller(make_spec(sandbox={"warm": 1}))
    env = _env(fake, PYTHONPATH=scripted_plugin_path(tmp_path), ROLLOUTD_SANDBOX_DIR=str(chosen))
    with open(tmp_path / "node.log", "wb") as log:
        proc = subprocess.Popen(NODE, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        # the warm pool's sandbox: made under the chosen directory, none under the fixture's
        wait_until(lambda: chosen.is_dir() and any(p.is_dir() for p in chosen.iterdir()) or proc.poll() is not None,
                   timeout=120, what="a warm sandbox in the chosen directory")
        assert proc.poll() is None, (tmp_path / "node.log").read_text()[-3000:]
        assert list(sandbox_dir.iterdir()) == []
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, (tmp_path / "node.log").read_text()[-3000:]
        assert [p for p in chosen.iterdir() if p.is_dir()] == []  # closed as the daemon left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("name, value", [("ROLLOUTD_SANDBOX_UID", "nobody"), ("ROLLOUTD_EGRESS_ALLOW", "mirror.local"),
                                         ("ROLLOUTD_IMAGE_MAX_MB", "8G")])
def test_a_bad_sandbox_variable_stops_the_start_naming_it(controller, name, value):
    fake = controller(make_spec())
    proc = subprocess.run(NODE, env=_env(fake, **{name: value}), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and name in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert fake.registers == []  # refused before it spoke to the controller
