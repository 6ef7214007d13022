"""A graceful stop loses no span: a real controller (tracing on, exporting to a real OTLP/HTTP receiver in the test,
tests/support/otlp_sink.py) whose job's node the test plays over the node protocol gets SIGTERM with attempts ended
and attempts in flight; every ended attempt's root and queue spans reach the receiver, and every attempt still in
flight has its root ended as `controller stopped` (not an error), so no daemon's span is left without its parent.

The batch schedule is set far beyond the test (`OTEL_BSP_SCHEDULE_DELAY` 10 min): what arrives was sent by the stop."""
from __future__ import annotations

import signal
from collections import Counter

import httpx
import yaml
from support.controller_process import ControllerProcess
from support.kube_helpers import EXAMPLE, job_yaml
from support.otlp_sink import OtlpSink
from support.sim.noop import HealthServer
from support.waiting import wait_until

from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.crds.node import FEATURES, NODE_PROTOCOL
from rolloutd.crds.trajectory import Trajectory

NODES = "/apis/rolloutd.io/v1alpha1/nodes"
PROMPTS, SAMPLES, ENDED = 12, 4, 30   # 48 attempts leased, 30 of them reported before the stop


def _result(lease: dict) -> dict:
    t = Trajectory(job="", prompt=lease["prompt"], sample=lease["sample"], task_id=str(lease["task"].get("id")),
                   finish_reason="stop", reward=1.0, node="sim", attempt=lease["attempt"])
    return {"attemptId": lease["attemptId"], "trajectory": t.wire()}


def test_a_sigterm_sends_every_ended_attempts_spans_and_ends_those_in_flight(tmp_path):
    health, sink = HealthServer(), OtlpSink()
    c = ControllerProcess(tmp_path / "data", executors="local",
                          env={**sink.env(), "OTEL_BSP_SCHEDULE_DELAY": "600000"})
    try:
        c.start()
        with c.client() as api:
            doc = yaml.safe_load(job_yaml("stopped"))
            doc["spec"]["tasks"].update(source=str(EXAMPLE.parent / "math" / "train.jsonl"), limit=PROMPTS)
            doc["spec"]["samplesPerPrompt"] = SAMPLES
            doc["spec"]["llm"] = {"tokenizer": str(model_dir("tiny")), "backends": [{"url": health.urls[0]}]}
            doc["spec"]["executor"]["nodes"] = 0   # no daemon process: the test is the node
            r = api.post("/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs", json=doc)
            assert r.status_code in (200, 201), r.text
            reg = api.post(f"{NODES}/register?features={','.join(FEATURES)}",
                           json={"job": "stopped", "protocol": NODE_PROTOCOL, "name": "sim0", "host": "sim", "pid": 0,
                                 "slot": 0})
            assert reg.status_code == 200, reg.text
            node, leases = reg.json()["nodeId"], []
            wait_until(lambda: leases.extend(api.post(f"{NODES}/{node}/lease", json={
                "maxItems": PROMPTS * SAMPLES, "wait": 2.0}).json()["leases"]) or len(leases) == PROMPTS * SAMPLES,
                       60, "every item leased")
            ack = api.post(f"{NODES}/{node}/results", json={"results": [_result(x) for x in leases[:ENDED]]}).json()
            assert sorted(ack["accepted"]) == sorted(x["attemptId"] for x in leases[:ENDED])
        assert sink.stored() == []   # nothing sent yet: the batch is far from full and its schedule far away
        c.stop(signal.SIGTERM)
    finally:
        c.stop(signal.SIGKILL)
        health.close()
    spans = sink.stored()
    sink.close()
    roots = {s["attributes"]["rolloutd.attempt.id"]: s for s in spans if s["name"] == "rollout"}
    queues = Counter(s["attributes"]["rolloutd.attempt.id"] for s in spans if s["name"] == "queue")
    assert len(roots) == len([s for s in spans if s["name"] == "rollout"])   # one root per attempt
    ended, in_flight = leases[:ENDED], leases[ENDED:]
    assert {x["attemptId"] for x in leases} == set(roots) == set(queues) and set(queues.values()) == {1}
    assert {roots[x["attemptId"]]["attributes"]["rolloutd.outcome"] for x in ended} == {"done"}
    assert {roots[x["attemptId"]]["attributes"]["rolloutd.outcome"] for x in in_flight} == {"controller stopped"}
    for x in leases:   # each root is the trace its lease's traceparent named
        assert x["traceparent"].split("-")[1] == roots[x["attemptId"]]["trace"]
