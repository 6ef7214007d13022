"""`rolloutctl inflight` and the rollout counters with a real controller (local executor), a real node daemon and
bwrap sandboxes running `agent.kind: oracle` on the test plug-in `scripted-oracle` (no LLM, no engine), whose
rollouts sit in RUN inside a bash tool call that sleeps, until the test deletes the job.

- both rollouts show as stalled in RUN (the controller's threshold set to 1 s), with their time in stage, node and
  a recent heartbeat (the node still beats: the rollout is stuck, not its node);
- a namespace token of another namespace is refused;
- /metrics counts the stalls, and deleting the job counts both rollouts as cleaned up on their node.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.cluster import Cluster, plugin_env
from support.waiting import wait_until

from rolloutd.client import RolloutClient
from rolloutd.controller.access.auth import create_scoped_token

pytestmark = pytest.mark.timeout(240)
NS = "team-a"


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, {**plugin_env(), "ROLLOUTD_STALLED_AFTER_SECONDS": "1"}).start()
    yield c
    c.stop()


def blocked_job(tmp_path: Path) -> dict:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": i, "question": f"{i}+{i}?", "answer": str(2 * i), "blockInTool": True})
                            + "\n" for i in range(2)))
    return {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": "stuck"},
            "spec": {"tasks": {"kind": "scripted-oracle", "source": str(data)}, "samplesPerPrompt": 1,
                     "agent": {"kind": "oracle"}, "sandbox": {"runtime": "bwrap", "warm": 0},
                     "executor": {"kind": "local", "nodes": 1},
                     "pipeline": {"workersPerNode": {"init": 2, "run": 2, "eval": 2}, "maxAttempts": 1}}}


def ctl(cluster: Cluster, token: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ROLLOUTD_SERVER": cluster.url, "ROLLOUTD_TOKEN": token,
           "ROLLOUTD_CONFIG": str(cluster.root / "no-config.yaml")}
    return subprocess.run([sys.executable, "-m", "rolloutd.controller.ctl", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def counters(cluster: Cluster) -> dict[str, float]:
    text = cluster.api.get("/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("rolloutd_rollout")}


def test_rollouts_blocked_in_a_tool_call_show_as_stalled_in_run_and_are_counted(cluster, tmp_path):
    with RolloutClient(cluster.url, token=cluster.token, namespace=NS) as rc:
        rc.apply(blocked_job(tmp_path))
        book = cluster.data_dir / "tokens"
        mine = create_scoped_token(book, "team-a", read_only=True, namespaces=[NS]).token
        other = create_scoped_token(book, "team-b", read_only=False, namespaces=["team-b"]).token

        def both_stalled_in_run():
            doc = rc.inflight("stuck")
            rows = doc["items"]
            return doc if len(rows) == 2 and all(r["stage"] == "run" and r["stalled"] for r in rows) else None
        doc = wait_until(both_stalled_in_run, timeout=120, what="both rollouts stalled in RUN", every=0.5)
        assert doc["total"] == 2 and doc["stalled"] == 2 and doc["stalledAfterSeconds"] == 1
        assert len({r["node"] for r in doc["items"]}) == 1  # the job's one node daemon
        for r in doc["items"]:
            assert r["inStageSeconds"] >= 1 and r["node"] and r["attempt"] == 1
            assert r["sinceHeartbeatSeconds"] < 10  # its node still beats: the rollout is what is stuck

        shown = ctl(cluster, mine, "-n", NS, "inflight", "stuck")
        assert shown.returncode == 0, shown.stderr
        lines = shown.stdout.splitlines()
        assert lines[0].startswith("2 in flight (2 run), 2 stalled") and lines[1].split()[:3] == [
            "ATTEMPT", "STAGE", "TURN"]
        assert len(lines) == 4 and all(line.split()[1] == "run" and line.rstrip().endswith("STALLED")
                                       for line in lines[2:])
        relaxed = json.loads(ctl(cluster, mine, "-n", NS, "inflight", "stuck", "--stalled-after", "3600",
                                 "-o", "json").stdout)
        assert relaxed["stalled"] == 0 and relaxed["total"] == 2
        refused = ctl(cluster, other, "-n", NS, "inflight", "stuck")
        assert refused.returncode == 1 and "Forbidden" in refused.stderr and "STALLED" not in refused.stdout

        # each stuck in RUN counted once however often scraped (and maybe before, a second in INIT setting up bwrap)
        stalls = counters(cluster)["rolloutd_rollout_stalls_total"]
        assert 2 <= stalls <= 6 and counters(cluster)["rolloutd_rollout_stalls_total"] == stalls
        rc.delete("stuck")
        wait_until(lambda: counters(cluster)["rolloutd_rollout_cleanups_total"] == 2, timeout=60,
                   what="both rollouts cancelled on their node", every=0.2)
        assert counters(cluster)["rolloutd_rollouts_masked_total"] == 0
