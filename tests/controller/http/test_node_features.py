"""Node-protocol features negotiated per daemon, against a real controller (local executor, its job's node played
by the test over HTTPS, tracing on so leases have a trace context to carry): a daemon of protocol 1 that declares
no feature — the shape of a daemon from before the traces and the keep-mode fence — registers, leases, beats and
reports, and every reply holds only fields its models knew (they refuse unknown ones); a daemon that declares the
features gets `traceparent` on its leases and the fence in its beats' replies, and its policy watch is answered
when the policy changes; a protocol newer than the
controller's is refused up front; a restarted controller answers each daemon as it registered."""
from __future__ import annotations

import httpx
import pytest
import yaml
from support.kube_controller import https_controller
from support.kube_helpers import EXAMPLE, job_yaml
from support.waiting import wait_until

from rolloutd.agents.engine.model_dirs import model_dir
from support.sim.noop import HealthServer
from rolloutd.crds.node import FEATURES, NODE_PROTOCOL
from rolloutd.crds.trajectory import Trajectory

NODES = "/apis/rolloutd.io/v1alpha1/nodes"
# the reply fields a daemon of NODE_PROTOCOL 1 knew (crds/node.py before a920ce9: no fence, no traceparent)
OLD = {"lease": {"attemptId", "item", "prompt", "sample", "attempt", "task", "backend", "policyVersion",
                 "queuedSeconds"},
       "leases": {"leases", "done", "drain"},
       "beat": {"cancel", "repin", "unknown", "drain", "leaseSeconds", "policyVersion", "llmPaused", "lease",
                "accepted", "dropped", "beatGap"},
       "ack": {"accepted", "dropped", "lease"},
       "register": {"nodeId", "job", "spec", "generation", "leaseSeconds", "heartbeatSeconds", "features",
                    "nodeToken", "policy", "policyName"}}


@pytest.fixture(scope="module")
def controller(tmp_path_factory):
    health = HealthServer()  # leasing waits for a healthy backend; nobody generates here
    c = https_controller(tmp_path_factory.mktemp("features"), executors="local",
                         env={"ROLLOUTD_TRACING": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"})
    admin = (c.data_dir / "token").read_text().strip()  # the admin acts as any node (a simulated one)
    with httpx.Client(base_url=c.url, verify=c.verify, timeout=30, headers={"Authorization": f"Bearer {admin}"}) as api:
        yield api, health.urls[0], c
    c.stop()
    health.close()


def apply_job(api: httpx.Client, name: str, backend: str, limit: int = 2) -> None:
    doc = yaml.safe_load(job_yaml(name))
    spec = doc["spec"]
    spec["tasks"].update(source=str(EXAMPLE.parent / "math" / "train.jsonl"), limit=limit)
    spec["samplesPerPrompt"] = 2
    spec["llm"] = {"tokenizer": str(model_dir("tiny")), "backends": [{"url": backend}]}
    spec["executor"]["nodes"] = 0  # no daemon process: the test is the node
    r = api.post("/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs", json=doc)
    assert r.status_code in (200, 201), r.text


def register(api: httpx.Client, job: str, protocol: int, features: tuple[str, ...] | None) -> dict:
    path = f"{NODES}/register" + (f"?features={','.join(features)}" if features is not None else "")
    r = api.post(path, json={"job": job, "protocol": protocol, "name": "sim0", "host": "sim", "pid": 0, "slot": 0})
    assert r.status_code == 200, r.text
    return r.json()


def lease_all(api: httpx.Client, node: str, n: int) -> list[dict]:
    replies: list[dict] = []
    wait_until(lambda: replies.append(api.post(f"{NODES}/{node}/lease", json={"maxItems": n, "wait": 2.0}).json())
               or sum(len(r["leases"]) for r in replies) == n, 60, f"{n} leases")
    return replies


def result(lease: dict) -> dict:
    t = Trajectory(job="", prompt=lease["prompt"], sample=lease["sample"], task_id=str(lease["task"].get("id")),
                   finish_reason="stop", reward=1.0, node="sim", attempt=lease["attempt"])
    return {"attemptId": lease["attemptId"], "trajectory": t.wire()}


NODE_IDS: dict[str, str] = {}  # old / new: the nodes the tests below registered, for the restart at the end


def test_an_old_daemon_without_features_gets_only_the_fields_it_knows(controller):
    api, backend, _ = controller
    apply_job(api, "old-node", backend, limit=3)  # 6 rollouts: the job still runs after the 4 below (the restart test)
    reg = register(api, "old-node", 1, None)
    assert set(reg) <= OLD["register"] and "features" not in reg
    node = NODE_IDS["old"] = reg["nodeId"]
    replies = lease_all(api, node, 4)
    leases = [lease for r in replies for lease in r["leases"]]
    for r in replies:
        assert set(r) <= OLD["leases"], r
    for lease in leases:
        assert set(lease) <= OLD["lease"], lease  # no traceparent, though the controller traces the attempt
    beat = api.post(f"{NODES}/{node}/heartbeat?lease=1", json={"stages": {x["attemptId"]: "run" for x in leases}})
    assert beat.status_code == 200 and set(beat.json()) <= OLD["beat"], beat.text  # no fence fields
    ack = api.post(f"{NODES}/{node}/results?lease=1", json={"results": [result(x) for x in leases]})
    assert ack.status_code == 200 and set(ack.json()) <= OLD["ack"], ack.text
    assert sorted(ack.json()["accepted"]) == sorted(x["attemptId"] for x in leases)  # it works end to end


def test_a_daemon_that_declares_the_features_gets_their_fields(controller):
    api, backend, _ = controller
    apply_job(api, "new-node", backend)
    reg = register(api, "new-node", NODE_PROTOCOL, FEATURES)
    assert set(reg["features"]) == set(FEATURES)
    node = NODE_IDS["new"] = reg["nodeId"]
    leases = [lease for r in lease_all(api, node, 4) for lease in r["leases"]]
    assert all(lease["traceparent"].startswith("00-") for lease in leases)
    beat = api.post(f"{NODES}/{node}/heartbeat", json={"stages": {x["attemptId"]: "run" for x in leases}}).json()
    assert beat["llmFence"] == 0 and beat["backendVersions"] == {}


def test_the_policy_watch_answers_a_change_as_it_happens(controller):
    """Feature policy-watch: a watch that knows no epoch is answered at once; one that knows the current epoch is
    held until the policy changes (here an announce), then answered with the new version; its report counts as a
    beat for the announce's wait."""
    import threading
    import time

    api, _, _ = controller
    node = NODE_IDS["new"]
    now = api.post(f"{NODES}/{node}/policy-watch", json={"epoch": -1, "wait": 20}).json()
    assert now["policyVersion"] is None and now["llmPaused"] is False and now["instance"]
    answers: list[tuple[float, dict]] = []

    def watch() -> None:
        started = time.monotonic()
        r = api.post(f"{NODES}/{node}/policy-watch", json={"instance": now["instance"], "epoch": now["epoch"],
                                                            "wait": 25, "llmInflight": 0})
        answers.append((time.monotonic() - started, r.json()))

    t = threading.Thread(target=watch)
    t.start()
    r = api.post("/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs/new-node/policy",
                 json={"version": 7, "pause": False})
    assert r.status_code == 200, r.text
    t.join(60)
    [(took, state)] = answers
    assert state["policyVersion"] == 7 and state["epoch"] > now["epoch"]
    assert took < 25  # answered by the change, not by the long-poll's end


def test_a_protocol_the_controller_does_not_know_is_refused_up_front(controller):
    api, backend, _ = controller
    apply_job(api, "future-node", backend)
    for protocol in (NODE_PROTOCOL + 1, None):
        r = api.post(f"{NODES}/register", json={"job": "future-node", "protocol": protocol, "name": "sim0"})
        assert r.status_code == 400 and "node protocol" in r.json()["message"], r.text


def test_a_restarted_controller_answers_each_daemon_as_it_registered(controller):
    api, _, c = controller
    c.restart()  # kill -9: the features come back from the nodes' rows, not from memory
    new = api.post(f"{NODES}/{NODE_IDS['new']}/heartbeat", json={}).json()
    old = api.post(f"{NODES}/{NODE_IDS['old']}/heartbeat", json={}).json()
    assert "llmFence" in new and "backendVersions" in new, new
    assert set(old) <= OLD["beat"], old
