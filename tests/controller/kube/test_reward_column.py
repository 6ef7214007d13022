"""The reward mean in `kubectl get rj`: a controller with the local executor runs a job whose node daemon is
simulated over the real node protocol (as bench/bench_operator.py does); the embedded operator's observation
writes status.rewardMean, the CRD's printer column shows it. An infrastructure failure carries no reward and
must not pull the mean down."""
from __future__ import annotations

import httpx
import pytest
import yaml
from support.kube_helpers import EXAMPLE, job_yaml
from support.waiting import wait_until

from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.crds.node import NODE_PROTOCOL
from rolloutd.crds.trajectory import Failure, FailureKind, Trajectory
from support.sim.noop import HealthServer


NODES = "/apis/rolloutd.io/v1alpha1/nodes"


@pytest.fixture(scope="module")
def health_url():
    """An LLM backend's /health, nothing more: leasing waits for a healthy backend; nobody generates here."""
    server = HealthServer()
    yield server.urls[0]
    server.close()


def _job(name: str, backend: str) -> str:
    doc = yaml.safe_load(job_yaml(name))
    spec = doc["spec"]
    spec["tasks"].update(source=str(EXAMPLE.parent / "math" / "train.jsonl"), limit=2)
    spec["samplesPerPrompt"] = 2
    # an absolute directory (tokenizers load offline only; the local executor's is checked at apply): none loads it
    spec["llm"] = {"tokenizer": str(model_dir("tiny")), "backends": [{"url": backend}]}
    spec["executor"]["nodes"] = 0  # no daemon process: the test is the node
    spec["pipeline"]["maxAttempts"] = 1  # an infrastructure failure is final at once
    return yaml.safe_dump(doc)


def _reward_cell(table: str) -> str:
    """The REWARD cell of the table's first row, by the header's column position (an empty cell has no word)."""
    header, row = table.splitlines()[:2]
    names = header.split()
    start = header.index("REWARD")
    after = names[names.index("REWARD") + 1]
    return row[start:header.index(after, start)].strip()


def _result(lease: dict, reward: float | None) -> dict:
    failure = Failure(kind=FailureKind.infra, reason="sandbox died") if reward is None else Failure()
    t = Trajectory(job="", prompt=lease["prompt"], sample=lease["sample"], task_id=str(lease["task"].get("id")),
                   finish_reason="stop", reward=reward, failure=failure, node="sim", attempt=lease["attempt"])
    return {"attemptId": lease["attemptId"], "trajectory": t.wire()}


def test_get_shows_the_reward_mean_of_scored_rollouts(local_kube, local_kubectl, health_url):
    kubectl = local_kubectl
    kubectl("apply", "-f", "-", input=_job("rewarded", health_url))
    wait_until(lambda: kubectl("get", "rj", "rewarded", "-o", "jsonpath={.status.phase}").stdout == "Provisioning",
               60, "the operator's first pass")
    assert _reward_cell(kubectl("get", "rj", "rewarded").stdout) == ""  # nothing scored yet: null, not 0

    admin = (local_kube.data_dir / "token").read_text().strip()  # the admin acts as any node (a simulated one)
    with httpx.Client(base_url=local_kube.url, verify=local_kube.verify, timeout=30,
                      headers={"Authorization": f"Bearer {admin}"}) as node:
        reg = node.post(f"{NODES}/register", json={"job": "rewarded", "protocol": NODE_PROTOCOL, "name": "sim0",
                                                    "host": "sim", "pid": 0, "slot": 0})
        assert reg.status_code == 200, reg.text
        node_id = reg.json()["nodeId"]
        leases: list[dict] = []

        def leased() -> bool:
            r = node.post(f"{NODES}/{node_id}/lease", json={"maxItems": 4, "wait": 2.0})
            r.raise_for_status()
            leases.extend(r.json().get("leases", []))
            return len(leases) == 4
        wait_until(leased, 60, "the job's 4 rollouts leased")
        rewards = [1.0, 0.0, 1.0, None]  # the last: an infrastructure failure, no reward
        ack = node.post(f"{NODES}/{node_id}/results",
                        json={"results": [_result(lease, r) for lease, r in zip(leases, rewards)]})
        assert ack.status_code == 200 and len(ack.json()["accepted"]) == 4, ack.text

    wait_until(lambda: kubectl("get", "rj", "rewarded", "-o", "jsonpath={.status.phase}").stdout == "Succeeded",
               60, "the job to finish")
    status = yaml.safe_load(kubectl("get", "rj", "rewarded", "-o", "yaml").stdout)["status"]
    assert status["rewardMean"] == pytest.approx(2 / 3, abs=1e-4)  # the infra failure is not a 0
    assert status["counts"]["succeeded"] == 3 and status["counts"]["failed"] == 1
    assert (status["counts"]["scored"], status["counts"]["infraFailed"]) == (3, 1)  # 1 of 4: under the ratio
    assert _reward_cell(kubectl("get", "rj", "rewarded").stdout) == "0.6667"


def test_kubectl_wait_for_complete_does_not_succeed_on_a_job_whose_rollouts_failed_as_infra(local_kube, local_kubectl,
                                                                                           health_url):
    """Issue 25: a job all of whose rollouts failed as infra ended Succeeded, Complete=True, and `kubectl wait
    --for=condition=Complete` reported success. Now it ends Failed (InfraFailures): the wait for Complete times out,
    the wait for Failed is met."""
    kubectl = local_kubectl
    kubectl("apply", "-f", "-", input=_job("all-infra", health_url))
    wait_until(lambda: kubectl("get", "rj", "all-infra", "-o", "jsonpath={.status.phase}").stdout == "Provisioning",
               60, "the operator's first pass")
    admin = (local_kube.data_dir / "token").read_text().strip()  # the admin acts as any node (a simulated one)
    with httpx.Client(base_url=local_kube.url, verify=local_kube.verify, timeout=30,
                      headers={"Authorization": f"Bearer {admin}"}) as node:
        reg = node.post(f"{NODES}/register", json={"job": "all-infra", "protocol": NODE_PROTOCOL, "name": "sim0",
                                                    "host": "sim", "pid": 0, "slot": 0})
        node_id = reg.json()["nodeId"]
        leases: list[dict] = []

        def leased() -> bool:
            r = node.post(f"{NODES}/{node_id}/lease", json={"maxItems": 4, "wait": 2.0})
            r.raise_for_status()
            leases.extend(r.json().get("leases", []))
            return len(leases) == 4
        wait_until(leased, 60, "the job's 4 rollouts leased")
        ack = node.post(f"{NODES}/{node_id}/results", json={"results": [_result(lease, None) for lease in leases]})
        assert ack.status_code == 200 and len(ack.json()["accepted"]) == 4, ack.text
    met = kubectl("wait", "rj/all-infra", "--for=condition=Failed", "--timeout=60s")
    assert "condition met" in met.stdout
    complete = kubectl("wait", "rj/all-infra", "--for=condition=Complete", "--timeout=3s", check=False)
    assert complete.returncode != 0 and "condition met" not in complete.stdout
    table = kubectl("get", "rj", "all-infra").stdout
    assert table.splitlines()[1].split()[1:7] == ["Failed", "0", "0", "0", "4", "4"], table
