"""`rolloutctl logs`: the node daemons' logs through the controller, with a real controller (local executor), a
real node daemon and bwrap sandboxes running `agent.kind: oracle` on the test plug-in `scripted-oracle` (no LLM,
no engine), held at a gate file so the job cannot end before the test lets it.

- the tail of the daemon's log, for all nodes and for one (`--node`), bounded by `--tail`;
- `-f` prints lines written after it started and ends by itself when the job ends;
- a namespace token reads its own namespace's job logs and not another's (403), and no request names a file.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from support.cluster import Cluster, plugin_env
from support.waiting import wait_until

from rolloutd.client import RolloutClient
from rolloutd.controller.access.auth import create_scoped_token
from rolloutd.crds.names import API_PREFIX

pytestmark = pytest.mark.timeout(240)
NS = "team-a"


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path, plugin_env()).start()
    yield c
    c.stop()


def gated_job(tmp_path: Path, gate: Path) -> dict:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"id": i, "question": f"{i}+{i}?", "answer": str(2 * i), "gate": str(gate)})
                            + "\n" for i in range(2)))
    return {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": "logs-demo"},
            "spec": {"tasks": {"kind": "scripted-oracle", "source": str(data)}, "samplesPerPrompt": 1,
                     "agent": {"kind": "oracle"}, "sandbox": {"runtime": "bwrap", "warm": 0},
                     "executor": {"kind": "local", "nodes": 1},
                     "pipeline": {"workersPerNode": {"init": 2, "run": 2, "eval": 2}, "maxAttempts": 1}}}


def ctl(cluster: Cluster, token: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "ROLLOUTD_SERVER": cluster.url, "ROLLOUTD_TOKEN": token,
           "ROLLOUTD_CONFIG": str(cluster.root / "no-config.yaml")}
    return subprocess.run([sys.executable, "-m", "rolloutd.controller.ctl", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_logs_tail_follow_until_the_job_ends_and_only_in_the_tokens_namespace(cluster, tmp_path):
    gate = tmp_path / "gate"
    with RolloutClient(cluster.url, token=cluster.token, namespace=NS) as rc:
        rc.apply(gated_job(tmp_path, gate))
    book = cluster.data_dir / "tokens"
    mine = create_scoped_token(book, "team-a", read_only=True, namespaces=[NS]).token
    other = create_scoped_token(book, "team-b", read_only=False, namespaces=["team-b"]).token

    def registered() -> bool:
        r = ctl(cluster, mine, "-n", NS, "logs", "logs-demo")
        return r.returncode == 0 and "registered with" in r.stdout
    wait_until(registered, timeout=120, what="the daemon's registration in its log", every=0.5)

    # the tail: one node here, so its lines unprefixed; --node 0 is that daemon, --node 1 has none yet
    shown = ctl(cluster, mine, "-n", NS, "logs", "logs-demo", "--node", "0")
    assert shown.returncode == 0 and "rolloutd-node" in shown.stdout and "registered with" in shown.stdout
    assert len(ctl(cluster, mine, "-n", NS, "logs", "logs-demo", "--tail", "2").stdout.splitlines()) == 2
    missing = ctl(cluster, mine, "-n", NS, "logs", "logs-demo", "--node", "1")
    assert missing.returncode == 1 and "no node daemon log for node 1" in missing.stderr

    # another namespace's token: refused, whichever way it names the job
    refused = ctl(cluster, other, "-n", NS, "logs", "logs-demo")
    assert refused.returncode == 1 and "Forbidden" in refused.stderr and "registered" not in refused.stdout
    assert ctl(cluster, other, "-n", "team-b", "logs", "logs-demo").returncode == 1  # not its job: 404
    r = httpx.get(f"{cluster.url}{API_PREFIX}/namespaces/{NS}/rolloutjobs/logs-demo/logs",
                  headers={"Authorization": f"Bearer {other}"})
    assert r.status_code == 403 and "registered" not in r.text
    # nothing of the request is a path: a name that looks like one is just a job that does not exist
    r = cluster.api.get(f"{API_PREFIX}/namespaces/{NS}/rolloutjobs/..%2F..%2Ftoken/logs")
    assert r.status_code == 404 and cluster.token not in r.text

    # -f: started while the job is held, it prints its one line of tail at once (so it is following: no sleep),
    # then what the daemon writes later, and ends with the job
    env = {**os.environ, "ROLLOUTD_SERVER": cluster.url, "ROLLOUTD_TOKEN": mine,
           "ROLLOUTD_CONFIG": str(cluster.root / "no-config.yaml")}
    follower = subprocess.Popen([sys.executable, "-m", "rolloutd.controller.ctl", "-n", NS, "logs", "logs-demo", "-f",
                                 "--tail", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(follower.stdout), daemon=True)
    reader.start()
    try:
        wait_until(lambda: lines or follower.poll() is not None, timeout=90, what="the follower's line of tail",
                   every=0.1)
        assert follower.poll() is None, follower.stderr.read()
        told = len(lines)
        gate.touch()  # the rollouts go on, the job finishes, its daemon says so and exits
        follower.wait(timeout=90)
    finally:
        if follower.poll() is None:
            follower.kill()
    reader.join(5)
    assert follower.returncode == 0, follower.stderr.read()
    phase = cluster.api.get(f"{API_PREFIX}/namespaces/{NS}/rolloutjobs/logs-demo").json()["status"]["phase"]
    assert phase == "Succeeded"
    assert told == 1, lines  # --tail 1: one line of what came before it started
    text = "".join(lines[1:])
    assert "registered with" not in text  # after the tail, only what the daemon wrote since
    assert "no more work for this node" in text, text  # written when the job ended


def test_the_local_executor_sends_a_bounded_tail_of_its_own_files_and_follows_no_link(tmp_path):
    """What `logs` reads on the local executor: only `<job>-node<K>.log` files that are files (a link planted where
    a daemon's log would be is not read), at most MAX_BYTES of tail whatever `tail` asks."""
    import asyncio

    from rolloutd.controller.executors.local import LocalExecutor
    from rolloutd.controller.executors.logs import MAX_BYTES, NoLogs
    from rolloutd.crds.rolloutjob import RolloutJob

    secret = tmp_path / "secret"
    secret.write_text("not a log\n")
    logs = tmp_path / "data" / "logs"
    logs.mkdir(parents=True)
    (logs / "team-a_j-node0.log").write_text("".join(f"line {i:07d} {'x' * 80}\n" for i in range(30_000)))  # ~2.7 MB
    (logs / "team-a_j-node1.log").symlink_to(secret)
    (logs / "team-a_j-node2.log.old").write_text("rotated\n")
    (logs / "team-a_jj-node3.log").write_text("another job's\n")
    job = RolloutJob.model_validate({"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob",
                                     "metadata": {"name": "j", "namespace": NS},
                                     "spec": {"tasks": {"kind": "math", "source": "/x"}, "agent": {"kind": "oracle"}}})
    ex = LocalExecutor("http://127.0.0.1:9", None, tmp_path / "data")

    async def read(node, tail):
        return "".join([chunk async for chunk in await ex.logs(job, node, tail, False)])

    text = asyncio.run(read(None, 10_000))
    assert len(text.encode()) <= MAX_BYTES and text.endswith(f"line {29_999:07d} {'x' * 80}\n")
    assert "not a log" not in text and "rotated" not in text and "another job" not in text and "[node" not in text
    assert asyncio.run(read(0, 3)).splitlines()[0].startswith(f"line {29_997:07d}")
    with pytest.raises(NoLogs):
        asyncio.run(read(1, 10))
