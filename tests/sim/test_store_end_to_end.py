"""A real controller process on each store (SQLite, and PostgreSQL on the session's server) runs a small job for
simulated node daemons (`tests/support/sim/simnodes.py`, the real node protocol) to Succeeded: every rollout
expected is delivered to the trainer's stream once, none lost, duplicated or made up."""
from __future__ import annotations

import json
import os
import subprocess
import time


from support.sim import module_command
from support.sim.ledger import audit, delivered
from support.sim.noop import PLUGINS, HealthServer, noop_job

from support.controller_process import ControllerProcess
from support.waiting import wait_until

P = "/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs"
PROMPTS, SAMPLES, NODES = 12, 8, 3  # 96 rollouts over 3 simulated nodes
TIME_FACTOR = 40.0  # rollouts of ~1 s (the sim's lognormal median of 40 s, divided)
RUN_SECONDS = 25.0  # the simulated nodes' life: the job needs a few seconds of it


def test_a_job_of_simulated_nodes_succeeds_with_every_trajectory_delivered_once(tmp_path, store_location):
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(f'{{"id":"r{i}"}}\n' for i in range(PROMPTS)))
    health = HealthServer()
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")])),
           "ROLLOUTD_MAX_EPISODES_PER_BACKEND": "1000000", "ROLLOUTD_TOKENIZER_ROOTS": str(tmp_path)}
    ctl = ControllerProcess(tmp_path / "data", executors="local", extra_args=("--store", str(store_location)),
                            env=env).start()
    shard = None
    try:
        with ctl.client() as api:
            name = "sim-job"
            api.post(P, json=noop_job(name, source, PROMPTS * SAMPLES, health.urls[:1])).raise_for_status()
            credential = api.post(f"{P}/{name}/nodes/credential").json()["credential"]
            cfg = {"url": ctl.url, "credential": credential, "job": name, "slots": 64, "nodes": NODES, "first": 0,
                   "time_factor": TIME_FACTOR, "median_seconds": 40.0, "sigma": 0.5, "seed": 1,
                   "start_at": time.time() + 1, "stop_at": time.time() + 1 + RUN_SECONDS}
            (tmp_path / "shard.json").write_text(json.dumps(cfg))
            argv, env = module_command("simnodes", str(tmp_path / "shard.json"), str(tmp_path / "shard.out.json"))
            shard = subprocess.Popen(argv, env=env)
            wait_until(lambda: api.get(f"{P}/{name}").json().get("status", {}).get("phase") == "Succeeded",
                       RUN_SECONDS + 60, "the simulated nodes to finish the job")
            assert shard.wait(RUN_SECONDS + 120) == 0
            out = json.loads((tmp_path / "shard.out.json").read_text())
            got = delivered(api, P, name)
            status = api.get(f"{P}/{name}").json()["status"]
        expected = {(p, s) for p in range(PROMPTS) for s in range(SAMPLES)}
        check = audit(out["ledger"]["accepted"], got, expected=expected)
        assert (check.accepted, check.delivered) == (len(expected), len(expected)), check
        assert (check.lost, check.duplicated, check.phantom) == ([], [], []), check
        assert status["counts"]["succeeded"] == len(expected)
    finally:
        if shard is not None and shard.poll() is None:
            shard.kill()
            shard.wait(10)
        ctl.stop()
        health.close()
