"""The controller's settings, against a real `rolloutd controller` process: its `ROLLOUTD_*` variables are read
once as it starts (`ControllerSettings.from_env` in main.py) and passed to the store, the scheduler and the API;
a value set in its environment takes effect, a bad one ends the start with a message naming the variable."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.controller_process import ControllerProcess, free_port
from support.kube_helpers import MERGE, NS, job_doc

JOBS = f"{NS}/default/rolloutjobs"


def test_the_watch_history_set_at_start_is_what_the_store_keeps(tmp_path, store_location):
    """ROLLOUTD_WATCH_HISTORY=4: a few changes later, a watch from the first version is 410 Expired (the default
    keeps 50 000 changes: the same watch would resume). On either store (ROLLOUTD_STORE)."""
    c = ControllerProcess(tmp_path / "data", env={"ROLLOUTD_WATCH_HISTORY": "4",
                                                  "ROLLOUTD_STORE": str(store_location)}).start()
    try:
        with c.client() as api:
            assert api.post(JOBS, json=job_doc("history")).status_code == 201
            for i in range(12):
                r = api.patch(f"{JOBS}/history", json={"metadata": {"labels": {"n": str(i)}}}, headers=MERGE)
                assert r.status_code == 200, r.text
            with api.stream("GET", JOBS, params={"watch": "1", "resourceVersion": "1", "timeoutSeconds": "2"}) as r:
                first = json.loads(next(r.iter_lines()))
            assert first["type"] == "ERROR" and first["object"]["code"] == 410, first
            latest = api.get(JOBS).json()["metadata"]["resourceVersion"]  # within the kept window: resumes
            with api.stream("GET", JOBS, params={"watch": "1", "resourceVersion": latest, "timeoutSeconds": "1"}) as r:
                assert all(json.loads(line)["type"] != "ERROR" for line in r.iter_lines() if line.strip())
    finally:
        c.stop()


@pytest.mark.parametrize("name, value", [
    ("ROLLOUTD_WATCH_HISTORY", "lots"), ("ROLLOUTD_NODE_CALLS_PER_SECOND", "fast"),
    ("ROLLOUTD_MAX_EPISODES_PER_BACKEND", "0"), ("ROLLOUTD_BACKEND_ALLOW_NETS", "169.254.0.0/33"),
])
def test_a_bad_variable_stops_the_start_naming_it(tmp_path, name, value):
    argv = [sys.executable, "-m", "rolloutd.controller.main", "controller", "--data-dir", str(tmp_path / "data"),
            "--port", str(free_port()), "--executors", ""]
    proc = subprocess.run(argv, env={**os.environ, name: value}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert name in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
