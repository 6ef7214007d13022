"""`rolloutd node` options: URL/job from flags or env, the join token only from env, the node name
from --name, SLURMD_NODENAME or the hostname, Slurm ids from the environment."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from rolloutd.agents.daemon.options import NodeError, NodeOptions


def test_options_from_env_and_flags():
    env = {"ROLLOUTD_CONTROLLER": "http://c:7350", "ROLLOUTD_JOB": "math-demo", "ROLLOUTD_JOIN_TOKEN": "t0k",
           "SLURMD_NODENAME": "gpu12", "SLURM_JOB_ID": "991", "SLURM_NODEID": "3", "ROLLOUTD_DRAIN_SECONDS": "7.5"}
    o = NodeOptions.from_env(environ=env)
    assert (o.controller, o.job, o.token, o.name) == ("http://c:7350", "math-demo", "t0k", "gpu12")
    assert (o.slurm_job_id, o.slurm_node_id, o.drain_seconds, o.slot) == ("991", 3, 7.5, None)
    o = NodeOptions.from_env(controller="http://other", job="j2", name="n9", slot=2, environ=env)
    assert (o.controller, o.job, o.name, o.slot) == ("http://other", "j2", "n9", 2)
    bare = NodeOptions.from_env(environ={"ROLLOUTD_CONTROLLER": "http://c", "ROLLOUTD_JOB": "j",
                                         "ROLLOUTD_JOIN_TOKEN": "t"})
    assert bare.name == socket.gethostname() and bare.slurm_job_id is None and bare.drain_seconds == 30


@pytest.mark.parametrize("missing, message", [
    ("ROLLOUTD_JOIN_TOKEN", "no join token"), ("ROLLOUTD_CONTROLLER", "no controller"), ("ROLLOUTD_JOB", "no job"),
])
def test_options_refuse_what_is_missing(missing, message):
    env = {"ROLLOUTD_CONTROLLER": "http://c", "ROLLOUTD_JOB": "j", "ROLLOUTD_JOIN_TOKEN": "t"}
    del env[missing]
    with pytest.raises(NodeError, match=message):
        NodeOptions.from_env(environ=env)


def test_cli_has_no_token_flag_and_needs_the_env():
    base = [sys.executable, "-m", "rolloutd.controller.main", "node"]
    env = {"PATH": "/usr/bin:/bin", "ROLLOUTD_CONTROLLER": "http://127.0.0.1:9", "ROLLOUTD_JOB": "j"}
    proc = subprocess.run([*base, "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0 and "--controller" in proc.stdout and "--token" not in proc.stdout
    proc = subprocess.run(base, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and "ROLLOUTD_JOIN_TOKEN" in proc.stderr


def test_ca_file_from_env_and_an_unreadable_one_refused(tmp_path):
    env = {"ROLLOUTD_CONTROLLER": "https://c", "ROLLOUTD_JOB": "j", "ROLLOUTD_JOIN_TOKEN": "t"}
    assert NodeOptions.from_env(environ=env).ca_file is None  # the system's CAs
    (tmp_path / "ca.pem").write_text("x")
    assert NodeOptions.from_env(environ={**env, "ROLLOUTD_CA_FILE": str(tmp_path / "ca.pem")}).ca_file == \
        str(tmp_path / "ca.pem")
    with pytest.raises(NodeError, match="ROLLOUTD_CA_FILE=.*absent.pem: no such readable file"):
        NodeOptions.from_env(environ={**env, "ROLLOUTD_CA_FILE": str(tmp_path / "absent.pem")})


def test_the_controllers_start_time_from_env_sets_when_a_daemon_gives_up():
    from rolloutd.agents.daemon.heartbeat import unreachable_after

    env = {"ROLLOUTD_CONTROLLER": "http://c", "ROLLOUTD_JOB": "j", "ROLLOUTD_JOIN_TOKEN": "t"}
    assert NodeOptions.from_env(environ=env).controller_start_seconds == 60
    quick = NodeOptions.from_env(environ={**env, "ROLLOUTD_CONTROLLER_START_SECONDS": "5"})
    assert unreachable_after(2.0, quick.controller_start_seconds) == 45.0  # 20 × 2 s + 5 s
    with pytest.raises(NodeError, match="ROLLOUTD_CONTROLLER_START_SECONDS must be a number of seconds"):
        NodeOptions.from_env(environ={**env, "ROLLOUTD_CONTROLLER_START_SECONDS": "soon"})
