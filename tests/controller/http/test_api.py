"""The controller API through a real uvicorn server (a `rolloutd controller` subprocess)."""
from __future__ import annotations

import json
import os
import stat
import threading

import httpx
import pytest
import yaml

P = "/apis/rolloutd.io/v1alpha1/rolloutjobs"
YAML = {"Content-Type": "application/yaml"}


def doc(example_yaml: str, name: str = "math-demo", **labels) -> dict:
    d = yaml.safe_load(example_yaml)
    d["metadata"]["name"] = name
    if labels:
        d["metadata"]["labels"] = labels
    return d


def put(api: httpx.Client, d: dict) -> httpx.Response:
    return api.put(f"{P}/{d['metadata']['name']}", json=d)


# ---------------------------------------------------------------- happy paths


def test_create_get_and_conflict(api, example_yaml):
    r = api.post(P, content=example_yaml, headers=YAML)
    assert r.status_code == 201, r.text
    obj = r.json()
    assert obj["metadata"]["generation"] == 1 and obj["metadata"]["uid"]
    assert obj["status"]["phase"] == "Pending"
    again = api.post(P, content=example_yaml, headers=YAML)
    assert again.status_code == 409 and again.json()["reason"] == "AlreadyExists"
    got = api.get(f"{P}/math-demo").json()
    assert got["metadata"]["uid"] == obj["metadata"]["uid"]
    assert api.get(f"{P}/nope").status_code == 404


def test_apply_unchanged_then_configured(api, example_yaml):
    d = doc(example_yaml)
    first = put(api, d)
    assert first.status_code == 201 and first.headers["x-rolloutd-outcome"] == "created"
    same = put(api, d)
    assert same.headers["x-rolloutd-outcome"] == "unchanged"
    assert same.json()["metadata"]["generation"] == 1
    d["spec"]["executor"]["nodes"] = 3
    changed = put(api, d)
    assert changed.status_code == 200 and changed.headers["x-rolloutd-outcome"] == "configured"
    assert changed.json()["metadata"]["generation"] == 2
    assert int(changed.json()["metadata"]["resourceVersion"]) > int(first.json()["metadata"]["resourceVersion"])
    d["metadata"]["labels"] = {"team": "rl", "tier": "gold"}  # metadata-only change: no new generation
    relabeled = put(api, d)
    assert relabeled.headers["x-rolloutd-outcome"] == "configured"
    assert relabeled.json()["metadata"]["generation"] == 2


def test_list_with_label_selector(api, example_yaml):
    put(api, doc(example_yaml, "a", team="rl", env="dev"))
    put(api, doc(example_yaml, "b", team="rl", env="prod"))
    put(api, doc(example_yaml, "c", team="infra"))

    def names(sel):
        r = api.get(P, params={"labelSelector": sel} if sel else {})
        assert r.status_code == 200
        return [i["metadata"]["name"] for i in r.json()["items"]]

    assert names(None) == ["a", "b", "c"]
    assert names("team=rl") == ["a", "b"]
    assert names("team=rl,env!=dev") == ["b"]
    assert names("env") == ["a", "b"]
    assert names("!env") == ["c"]


def test_delete_cancels_then_removes(api, example_yaml):
    put(api, doc(example_yaml))
    r = api.delete(f"{P}/math-demo")
    assert r.status_code == 202
    assert r.json()["metadata"]["deletionTimestamp"]
    assert r.json()["status"]["phase"] == "Cancelling"
    # the reconciler finishes the deletion; follow it through the watch stream, no polling
    seen = []
    with api.stream("GET", P, params={"watch": "true", "resourceVersion": r.json()["metadata"]["resourceVersion"],
                                      "timeoutSeconds": 20}) as s:
        for ev in sse(s.iter_lines()):
            seen.append((ev["event"], ev["data"]["status"]["phase"]))
            if ev["event"] == "DELETED":
                break
    assert seen[-1] == ("DELETED", "Cancelled")
    assert api.get(f"{P}/math-demo").status_code == 404
    assert api.delete(f"{P}/math-demo").status_code == 404


def test_status_subresource(api, example_yaml):
    created = put(api, doc(example_yaml)).json()
    status = {"phase": "Running", "counts": {"total": 8, "run": 3}}
    r = api.put(f"{P}/math-demo/status", json={"status": status})
    assert r.status_code == 200, r.text
    assert r.json()["status"]["counts"]["run"] == 3
    assert r.json()["metadata"]["generation"] == created["metadata"]["generation"]  # status never bumps it
    stale = api.put(f"{P}/math-demo/status", json={"metadata": {"resourceVersion": created["metadata"]["resourceVersion"]},
                                                    "status": status})
    assert stale.status_code == 409
    bad = api.put(f"{P}/math-demo/status", json={"status": {"phase": "Dancing"}})
    assert bad.status_code == 422 and bad.json()["details"]["causes"][0]["field"] == "status.phase"
    # the spec is never changed through /status
    assert api.get(f"{P}/math-demo").json()["spec"] == created["spec"]


# ---------------------------------------------------------------- watch


def sse(lines):
    ev = {}
    for line in lines:
        if line == "":
            if "data" in ev:
                ev["data"] = json.loads(ev["data"])
                yield ev
            ev = {}
        elif line.startswith(":"):
            continue
        else:
            k, _, v = line.partition(": ")
            ev[k] = v


def test_watch_resumes_without_missing_or_duplicating(api, controller, example_yaml):
    start_rv = api.get(P).json()["metadata"]["resourceVersion"]
    d = doc(example_yaml, "w1")
    put(api, d)
    for n in (2, 3, 4):
        d["spec"]["executor"]["nodes"] = n
        put(api, d)
    # first connection: read two events, then drop the connection
    got = []
    with api.stream("GET", P, params={"watch": "true", "resourceVersion": start_rv}) as s:
        for ev in sse(s.iter_lines()):
            got.append(ev)
            if len(got) == 2:
                break
    # changes while disconnected
    for n in (5, 6):
        d["spec"]["executor"]["nodes"] = n
        put(api, d)
    put(api, doc(example_yaml, "w2"))
    # reconnect with Last-Event-ID = the last id seen
    with api.stream("GET", P, params={"watch": "true", "timeoutSeconds": 5},
                    headers={"Last-Event-ID": got[-1]["id"]}) as s:
        for ev in sse(s.iter_lines()):
            got.append(ev)
            if ev["data"]["metadata"]["name"] == "w2":
                break
    ids = [int(e["id"]) for e in got]
    assert ids == sorted(set(ids)), "events must be strictly increasing: none duplicated"
    assert ids == list(range(int(start_rv) + 1, int(start_rv) + 1 + len(ids))), "no event missed"
    # the reconciler's own status updates are interleaved; every spec change is there, in order
    assert (got[0]["event"], got[0]["data"]["metadata"]["name"]) == ("ADDED", "w1")
    assert (got[-1]["event"], got[-1]["data"]["metadata"]["name"]) == ("ADDED", "w2")
    nodes = [e["data"]["spec"]["executor"]["nodes"] for e in got if e["data"]["metadata"]["name"] == "w1"]
    assert [n for i, n in enumerate(nodes) if i == 0 or nodes[i - 1] != n] == [2, 3, 4, 5, 6]


def test_watch_without_version_starts_with_current_objects_and_streams_live(api, example_yaml):
    put(api, doc(example_yaml, "x1", team="rl"))
    put(api, doc(example_yaml, "x2", team="other"))
    events = []
    ready = threading.Event()

    def writer():
        ready.wait(10)
        put(api, doc(example_yaml, "x3", team="rl"))

    t = threading.Thread(target=writer)
    t.start()
    with api.stream("GET", P, params={"watch": "true", "labelSelector": "team=rl", "timeoutSeconds": 20}) as s:
        for ev in sse(s.iter_lines()):
            if ev["event"] == "BOOKMARK":
                ready.set()
                continue
            if ev["event"] == "MODIFIED":  # the operator's writes (status, its annotations) may land any time
                continue
            events.append((ev["event"], ev["data"]["metadata"]["name"]))
            if ev["data"]["metadata"]["name"] == "x3":
                break
    t.join()
    assert events == [("ADDED", "x1"), ("ADDED", "x3")]


def test_watch_from_garbage_version_is_a_clear_400(api):
    r = api.get(P, params={"watch": "true", "resourceVersion": "abc"})
    assert r.status_code == 400 and "resourceVersion" in r.json()["message"]


# ---------------------------------------------------------------- bad input


def _status(r: httpx.Response, code: int) -> dict:
    assert r.status_code == code, r.text
    body = r.json()
    assert body["kind"] == "Status" and body["status"] == "Failure" and body["code"] == code
    return body


def _fields(body: dict) -> list[str]:
    return [c["field"] for c in body["details"].get("causes", [])]


def test_malformed_yaml_names_the_line(bad_api):
    body = _status(bad_api.post(P, content="apiVersion: rolloutd.io/v1alpha1\nkind: [unclosed\n", headers=YAML), 400)
    assert "line" in body["message"]


def test_malformed_json(bad_api):
    _status(bad_api.post(P, content='{"apiVersion": ', headers={"Content-Type": "application/json"}), 400)


def test_not_a_mapping(bad_api):
    body = _status(bad_api.post(P, content="- just\n- a list\n", headers=YAML), 400)
    assert "list" in body["message"]


def test_unknown_field_is_named_with_its_path(bad_api, example_yaml):
    d = doc(example_yaml)
    d["spec"]["sandbox"]["limits"]["gpus"] = 1
    body = _status(put(bad_api, d), 422)
    assert _fields(body) == ["spec.sandbox.limits.gpus"]
    assert "unknown field" in body["message"] and "memoryMB" in body["message"]


def test_wrong_type_is_named(bad_api, example_yaml):
    d = doc(example_yaml)
    d["spec"]["agent"]["sampling"]["temperature"] = "hot"
    body = _status(put(bad_api, d), 422)
    assert _fields(body) == ["spec.agent.sampling.temperature"]


def test_invalid_name(bad_api, example_yaml):
    d = doc(example_yaml, "Not_A_DNS_Label")
    body = _status(bad_api.post(P, json=d), 422)
    assert _fields(body) == ["metadata.name"]
    assert "DNS-1123" in body["message"]


def test_name_in_url_must_match_body(bad_api, example_yaml):
    body = _status(bad_api.put(f"{P}/other", json=doc(example_yaml)), 400)
    assert _fields(body) == ["metadata.name"]


def test_wrong_api_version_and_kind(bad_api, example_yaml):
    d = doc(example_yaml)
    d["apiVersion"], d["kind"] = "batch/v1", "Job"
    body = _status(put(bad_api, d), 400)
    assert _fields(body) == ["apiVersion", "kind"]


def test_missing_required_field(bad_api, example_yaml):
    d = doc(example_yaml)
    del d["spec"]["llm"]
    body = _status(put(bad_api, d), 422)
    assert _fields(body) == ["spec.llm"]


def test_body_over_the_limit_is_413(bad_api):
    big = "a" * (1 << 20 + 1)
    _status(bad_api.post(P, content=f"x: {big}\n", headers=YAML), 413)


def test_chunked_body_over_the_limit_is_413(bad_api):
    def chunks():
        for _ in range(40):
            yield b"#" * 65536
    _status(bad_api.post(P, content=chunks(), headers=YAML), 413)


def test_unsupported_media_type(bad_api):
    _status(bad_api.post(P, content=b"x", headers={"Content-Type": "application/octet-stream"}), 415)


def test_immutable_field(bad_api, example_yaml):
    d = doc(example_yaml, "immutable")
    put(bad_api, d)
    d["spec"]["tasks"]["source"] = "/data/math/other.jsonl"
    d["spec"]["executor"]["kind"] = "slurm"
    body = _status(put(bad_api, d), 422)
    assert _fields(body) == ["spec.tasks", "spec.executor.kind"]
    assert all(c["reason"] == "FieldValueForbidden" for c in body["details"]["causes"])
    assert bad_api.get(f"{P}/immutable").json()["metadata"]["generation"] == 1  # nothing was written


def test_bad_query_parameter_is_400_not_500(bad_api):
    _status(bad_api.get(P, params={"watch": "maybe"}), 400)
    _status(bad_api.get(P, params={"fieldSelector": "spec.x=1"}), 400)


# ---------------------------------------------------------------- auth, health, metrics


def test_auth(shared_controller):
    controller = shared_controller
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
        r = httpx.get(controller.url + P, headers=headers)
        body = _status(r, 401)
        assert "token" in body["message"]
    for path in ("/metrics", "/openapi.json", P + "/x"):
        assert httpx.get(controller.url + path).status_code == 401
    assert httpx.get(controller.url + "/healthz").text == "ok"
    mode = stat.S_IMODE(os.stat(controller.data_dir / "token").st_mode)
    assert mode == 0o600


def test_metrics_and_openapi(api, example_yaml):
    put(api, doc(example_yaml))
    text = api.get("/metrics").text
    assert 'rolloutd_jobs{phase="Pending"} 1.0' in text
    assert "rolloutd_api_requests_total" in text
    spec = api.get("/openapi.json").json()
    assert "/apis/rolloutd.io/v1alpha1/rolloutjobs/{name}" in spec["paths"]


# ---------------------------------------------------------------- restart safety


def test_restart_keeps_every_job_and_status(controller, example_yaml):
    with controller.client() as api:
        for i in range(5):
            put(api, doc(example_yaml, f"job-{i}", idx=str(i)))
        api.put(f"{P}/job-3/status", json={"status": {"phase": "Running", "counts": {"total": 4, "run": 2}}})
        before = api.get(P).json()
    token = controller.token
    controller.restart()  # SIGKILL: no clean shutdown
    assert controller.token == token, "the token survives restarts"
    with controller.client() as api:
        after = api.get(P).json()
        def ident(items):  # the operator may have written status and its own annotations since: not compared
            return [({k: v for k, v in i["metadata"].items() if k not in ("resourceVersion", "managedFields")}
                     | {"annotations": {a: v for a, v in i["metadata"].get("annotations", {}).items()
                                        if not a.startswith("rolloutd.io/")}}, i["spec"]) for i in items]

        assert ident(after["items"]) == ident(before["items"]) and len(after["items"]) == 5
        assert api.get(f"{P}/job-3").json()["status"]["counts"]["run"] == 2
        nxt = put(api, doc(example_yaml, "job-new")).json()
        assert int(nxt["metadata"]["resourceVersion"]) > int(before["metadata"]["resourceVersion"])


def test_trajectory_reports_may_exceed_the_spec_body_limit(shared_controller):
    """A long rollout's report is bigger than a RolloutJob may be: /results has its own limit."""
    with shared_controller.client() as api:
        traj = {"job": "x", "prompt": 0, "sample": 0, "tokenIds": list(range(300_000))}
        body = {"results": [{"attemptId": "a", "trajectory": traj}]}
        r = api.post("/apis/rolloutd.io/v1alpha1/nodes/nope/results", json=body)
        assert r.status_code == 404 and "not registered" in r.json()["message"]  # parsed, then refused
        r = api.post("/apis/rolloutd.io/v1alpha1/nodes/register", json={"job": "x", "name": "n", "pad": "a" * (2 << 20)})
        assert r.status_code == 413  # everything else keeps the 1 MiB limit
