"""`rolloutctl describe` of a job that ran: the agent kind, the reward mean and each stage's p50/p95 (queue, init,
run, eval) from the trajectories' timings, computed by the controller (`GET …/stats`, the web UI's own sums).
A real controller (local executor), a real node daemon and bwrap sandboxes, `agent.kind: oracle` on the test
plug-in `scripted-oracle` (no LLM, no engine)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.cluster import Cluster, plugin_env

from rolloutd.client import RolloutClient

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, plugin_env()).start()
    yield c
    c.stop()


def test_describe_shows_agent_kind_reward_mean_and_stage_percentiles(cluster, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": i, "question": f"{i}+{i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(3)))
    doc = {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": "desc-demo"},
           "spec": {"tasks": {"kind": "scripted-oracle", "source": str(data)}, "samplesPerPrompt": 2,
                    "agent": {"kind": "oracle"}, "sandbox": {"runtime": "bwrap", "warm": 0},
                    "executor": {"kind": "local", "nodes": 1}}}
    with RolloutClient(cluster.url, token=cluster.token, namespace="team-a") as rc:
        rc.apply(doc)
        rc.wait("desc-demo", "Complete", timeout=180)
        stats = rc.stats("desc-demo")
    assert stats["delivered"] == 6 and stats["rewardMean"] == 1.0
    assert [(s["stage"], s["n"]) for s in stats["stages"]] == [("queue", 6), ("init", 6), ("run", 6), ("eval", 6)]

    env = {**os.environ, "ROLLOUTD_SERVER": cluster.url, "ROLLOUTD_TOKEN": cluster.token,
           "ROLLOUTD_CONFIG": str(cluster.root / "no-config.yaml")}
    out = subprocess.run([sys.executable, "-m", "rolloutd.controller.ctl", "-n", "team-a", "describe", "rj",
                          "desc-demo"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^  Agent:\s+oracle, ", out.stdout, re.M), out.stdout
    assert re.search(r"^  Reward:\s+1\.0 ", out.stdout, re.M), out.stdout
    for s in stats["stages"]:  # the controller's numbers, as printed
        assert re.search(rf"^    {s['stage']:<6}\s+{s['p50']:.3f} / {s['p95']:.3f}\s+n=6$", out.stdout, re.M), out.stdout
