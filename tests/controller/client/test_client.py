"""The trainer client's logic against a scripted controller (httpx.MockTransport): every test
runs on the sync and on the async client (the `api` fixture), which must behave the same."""
from __future__ import annotations

import json

import httpx
import pytest
from support.client_fake import J, P, Stream, Ticks, ndjson, status, traj

from rolloutd.client import (
    Batch, ConnectionFailed, Invalid, JobEnded, NotFound, RolloutdError, WaitTimeout, retry,
)

JOB = {"apiVersion": "rolloutd.io/v1alpha1", "kind": "RolloutJob", "metadata": {"name": "j"},
       "spec": {"tasks": {"kind": "math", "source": "x.jsonl"}, "samplesPerPrompt": 2, "llm": {"tokenizer": "t"}}}


def obj(rv: int = 5, phase: str = "Running", conditions=()) -> dict:
    return {**JOB, "metadata": {"name": "j", "resourceVersion": str(rv)},
            "status": {"phase": phase, "conditions": list(conditions)}}


# ---------------------------------------------------------------- errors


def test_a_status_becomes_a_typed_error_with_reason_code_and_causes(api, fake):
    causes = [{"field": "spec.agent.maxTurn", "reason": "FieldValueUnknown", "message": "unknown field"}]
    fake.on("PUT", "j", status(422, "Invalid", "RolloutJob is invalid: spec.agent.maxTurn: unknown field", causes))
    with pytest.raises(Invalid) as e:
        api("apply", JOB)
    assert e.value.code == 422 and e.value.reason == "Invalid" and e.value.causes == causes
    assert "spec.agent.maxTurn" in str(e.value)
    assert fake.requests[0].headers["authorization"] == "Bearer t0ken"


def test_not_found_and_a_non_status_body(api, fake):
    fake.on("GET", "nope", status(404, "NotFound", "rolloutjob 'nope' not found"))
    with pytest.raises(NotFound) as e:
        api("get", "nope")
    assert e.value.code == 404 and isinstance(e.value, RolloutdError)
    fake.on("GET", "j/policy", httpx.Response(502, text="bad gateway"))
    api.client.retry_for = 0  # a 502 is retried by default (test_retry.py)
    with pytest.raises(RolloutdError) as e:
        api("policy", "j")
    assert e.value.code == 502 and "bad gateway" in str(e.value)


def test_an_unreachable_controller_is_connection_failed(api, fake):
    fake.on("GET", "j", httpx.ConnectError("connection refused"))
    api.client.retry_for = 0
    with pytest.raises(ConnectionFailed) as e:
        api("get", "j")
    assert "controller.test" in str(e.value) and e.value.code is None


# ---------------------------------------------------------------- jobs


def test_apply_from_a_dict_a_yaml_file_and_yaml_text(api, fake, tmp_path):
    fake.on("PUT", "j", httpx.Response(201, json=obj(1), headers={"X-Rolloutd-Outcome": "created"}))
    assert api("apply", JOB)["metadata"]["resourceVersion"] == "1"
    path = tmp_path / "job.yaml"
    path.write_text("apiVersion: rolloutd.io/v1alpha1\nkind: RolloutJob\nmetadata: {name: j}\nspec: {}\n")
    api("apply", path)
    api("apply", str(path))
    api("apply", path.read_text())
    assert api("apply_with_outcome", JOB)[1] == "created"
    bodies = [json.loads(r.content) for r in fake.calls("PUT", "j")]
    assert bodies[0] == JOB and all(b["metadata"]["name"] == "j" for b in bodies)
    with pytest.raises(RolloutdError, match="metadata.name"):
        api("apply", {"kind": "RolloutJob", "metadata": {}})


def test_wait_follows_the_watch_until_the_condition_and_fails_fast_when_the_job_ends(api, fake):
    done = obj(9, "Succeeded", [{"type": "Complete", "status": "True"}])
    sse = (f"id: 7\nevent: MODIFIED\ndata: {json.dumps(obj(7))}\n\n: keepalive\n\n"
           f"id: 9\nevent: MODIFIED\ndata: {json.dumps(done)}\n\n").encode()
    fake.on("GET", "j", httpx.Response(200, json=obj(5)))
    fake.on("GET", P, lambda r: httpx.Response(200, stream=Stream([sse])))
    assert api("wait", "j")["metadata"]["resourceVersion"] == "9"
    watch = fake.calls("GET", P)[0]
    assert watch.url.params["resourceVersion"] == "5" and watch.url.params["fieldSelector"] == "metadata.namespace=default,metadata.name=j"

    failed = obj(3, "Failed", [{"type": "Complete", "status": "False", "message": "dataset missing"}])
    fake.routes[("GET", f"{J}/j")] = [httpx.Response(200, json=failed)]
    with pytest.raises(JobEnded, match="dataset missing"):
        api("wait", "j")


def test_wait_times_out_with_the_last_state(api, fake):
    fake.on("GET", "j", httpx.Response(200, json=obj(5)))
    fake.on("GET", P, lambda r: httpx.Response(200, stream=Stream([b": keepalive\n\n"])))
    with pytest.raises(WaitTimeout) as e:
        api("wait", "j", timeout=0.2)
    assert isinstance(e.value, TimeoutError) and e.value.last["metadata"]["resourceVersion"] == "5"


def test_delete_with_wait_returns_once_deleted(api, fake):
    fake.on("DELETE", "j", httpx.Response(202, json=obj(6, "Cancelling")))
    sse = f"id: 8\nevent: DELETED\ndata: {json.dumps(obj(8))}\n\n".encode()
    fake.on("GET", P, lambda r: httpx.Response(200, stream=Stream([sse])))
    assert api("delete", "j", wait=True)["status"]["phase"] == "Cancelling"
    assert fake.calls("GET", P)[0].url.params["resourceVersion"] == "6"


# ---------------------------------------------------------------- trajectories


def test_a_dropped_trajectory_stream_resumes_after_the_last_seq(api, fake):
    first = ndjson([traj(1), traj(2)]) + b"\n" + b'{"seq": 3, "job": "j", "tok'   # cut mid-line
    fake.on("GET", "j/trajectories",
            lambda r: httpx.Response(200, stream=Stream([first], httpx.RemoteProtocolError("peer closed"))),
            lambda r: httpx.Response(200, stream=Stream([ndjson([traj(3), traj(4)])], httpx.ReadError("reset"))),
            lambda r: httpx.Response(200, stream=Stream([b"\n", ndjson([traj(5)])])))
    got = api("trajectories", "j", follow=True)
    assert [t["seq"] for t in got] == [1, 2, 3, 4, 5]   # nothing lost, nothing repeated
    cursors = [int(r.url.params["cursor"]) for r in fake.calls("GET", "j/trajectories")]
    assert cursors == [0, 2, 4]
    assert all(r.url.params["follow"] == "true" for r in fake.calls("GET", "j/trajectories"))


def test_a_stream_that_keeps_failing_gives_up_with_connection_failed(api, fake, monkeypatch):
    monkeypatch.setattr(retry, "time", Ticks())
    api.client.retry_for, api.client.retry_backoff = 0.3, 0.01
    fake.on("GET", "j/trajectories", lambda r: httpx.Response(200, stream=Stream([], httpx.ReadError("reset"))))
    with pytest.raises(ConnectionFailed, match="after retrying for"):
        api("trajectories", "j", follow=True)
    n = len(fake.calls("GET", "j/trajectories"))
    assert n == 4, n   # backed off, and gave up at the budget


def test_a_4xx_on_the_stream_is_raised_not_retried(api, fake):
    fake.on("GET", "j/trajectories", status(404, "NotFound", "rolloutjob 'j' not found"))
    with pytest.raises(NotFound):
        api("trajectories", "j", follow=True)
    assert len(fake.calls("GET", "j/trajectories")) == 1


def test_without_follow_every_page_is_fetched(api, fake):
    rows = [traj(i) for i in range(1, 2501)]

    def page(r: httpx.Request) -> httpx.Response:
        cursor, limit = int(r.url.params["cursor"]), int(r.url.params["limit"])
        return httpx.Response(200, content=ndjson([t for t in rows if t["seq"] > cursor][:limit]))
    fake.on("GET", "j/trajectories", page)
    got = api("trajectories", "j", cursor=0)
    assert [t["seq"] for t in got] == list(range(1, 2501))
    assert [int(r.url.params["cursor"]) for r in fake.calls("GET", "j/trajectories")] == [0, 1000, 2000]


def test_iter_groups_yields_whole_groups_as_their_last_sample_arrives(api, fake):
    fake.on("GET", "j", httpx.Response(200, json=obj()), httpx.Response(200, json=obj(phase="Succeeded")))
    stream = ndjson([traj(1, prompt=0, sample=1, reward=1.0), traj(2, prompt=1, sample=0, reward=0.0),
                     traj(3, prompt=0, sample=0, reward=0.0), traj(4, prompt=2, sample=0)])
    fake.on("GET", "j/trajectories", lambda r: httpx.Response(200, stream=Stream([stream])))
    groups = api("iter_groups", "j")
    assert [(g.prompt, g.rewards) for g in groups] == [(0, [0.0, 1.0])]   # sorted by sample; 1 and 2 incomplete


# ---------------------------------------------------------------- batches


def wire_batch(k: int, state: str, counted: int, groups: list[dict] | None = None) -> dict:
    return {"batch": k, "state": state, "target": 2, "counted": counted, "groups": groups or [],
            "cancelledRollouts": 3, "neverStarted": 1, "savedTokensEstimate": 1200, "secondsToFill": 4.5}


def test_next_batch_requests_then_long_polls_until_complete(api, fake):
    groups = [{"group": 11, "prompt": 4, "state": "counted", "rewards": [1.0, 0.0],
               "samples": [traj(0, 4, 0, 1.0), traj(0, 4, 1, 0.0)]}]
    fake.on("POST", "j/batches", httpx.Response(200, json={"batch": 3, "state": "running", "target": 2, "counted": 0}))
    fake.on("GET", "j/batches/3", httpx.Response(200, json=wire_batch(3, "running", 1)),
            httpx.Response(200, json=wire_batch(3, "complete", 2, groups)))
    b = api("next_batch", "j")
    assert isinstance(b, Batch) and b.complete and b.batch == 3 and b.counted == 2
    assert (b.cancelled_rollouts, b.never_started, b.saved_tokens_estimate, b.seconds_to_fill) == (3, 1, 1200, 4.5)
    assert b.groups[0].group == 11 and b.groups[0].prompt == 4 and b.groups[0].rewards == [1.0, 0.0]
    assert json.loads(fake.calls("POST", "j/batches")[0].content) == {}
    polls = fake.calls("GET", "j/batches/3")
    assert len(polls) == 2 and all(p.url.params["wait"] == "true" for p in polls)
    assert all(float(p.url.params["timeoutSeconds"]) > 0 for p in polls)


def test_next_batch_after_a_timeout_waits_for_the_same_batch(api, fake):
    fake.on("POST", "j/batches", httpx.Response(200, json={"batch": 7, "state": "running"}))
    fake.on("GET", "j/batches/7", httpx.Response(200, json=wire_batch(7, "running", 1)))
    with pytest.raises(WaitTimeout) as e:
        api("next_batch", "j", timeout=0.05)
    assert e.value.last.batch == 7 and e.value.last.counted == 1
    fake.routes[("GET", f"{J}/j/batches/7")] = [httpx.Response(200, json=wire_batch(7, "complete", 2))]
    assert api("next_batch", "j").batch == 7
    assert len(fake.calls("POST", "j/batches")) == 1   # not a second request: batch 7 would be skipped


def test_request_batch_by_number_and_batch_without_waiting(api, fake):
    fake.on("POST", "j/batches", httpx.Response(200, json={"batch": 2, "state": "complete", "target": 2, "counted": 2}))
    assert api("request_batch", "j", batch=2)["state"] == "complete"
    assert json.loads(fake.calls("POST", "j/batches")[0].content) == {"batch": 2}
    fake.on("GET", "j/batches/2", httpx.Response(200, json=wire_batch(2, "running", 0)))
    b = api("batch", "j", 2, wait=False, all_groups=True)
    q = fake.calls("GET", "j/batches/2")[0].url.params
    assert b.state == "running" and "wait" not in q and q["all"] == "true"


# ---------------------------------------------------------------- policy and backends


def test_announce_policy_sends_the_documented_body_and_waits_without_a_read_timeout(api, fake):
    answer = {"version": 4, "pausedSeconds": 1.5, "backends": [{"url": "http://b:8000", "reloaded": True, "error": None}]}
    fake.on("POST", "j/policy", httpx.Response(200, json=answer))
    fake.on("GET", "j/policy", httpx.Response(200, json={"version": 4, "history": []}))
    assert api("announce_policy", "j", 4, weights_path="/ckpt/4") == answer
    assert api("announce_policy", "j", "v5", pause=False)["version"] == 4
    bodies = [json.loads(r.content) for r in fake.calls("POST", "j/policy")]
    assert bodies == [{"version": 4, "weightsPath": "/ckpt/4", "pause": True},
                      {"version": "v5", "weightsPath": None, "pause": False}]
    assert fake.calls("POST", "j/policy")[0].extensions["timeout"]["read"] is None
    assert api("policy", "j")["version"] == 4


def test_backends_list_add_remove(api, fake):
    item = {"url": "http://b:8000", "healthy": True, "reason": "", "inflight": 0, "pinnedToJob": 0}
    fake.on("GET", "j/backends", httpx.Response(200, json={"items": [item]}))
    fake.on("POST", "j/backends", httpx.Response(200, json={"items": [item, {**item, "url": "http://c:8000"}]}))
    fake.on("DELETE", "j/backends", httpx.Response(200, json={"items": [item]}))
    assert api("backends", "j") == [item]
    assert len(api("add_backend", "j", "http://c:8000")) == 2
    assert api("remove_backend", "j", "http://c:8000") == [item]
    assert json.loads(fake.calls("POST", "j/backends")[0].content) == {"url": "http://c:8000"}
    assert fake.calls("DELETE", "j/backends")[0].url.params["url"] == "http://c:8000"


def test_the_async_client_has_every_method_of_the_sync_one_with_the_same_parameters():
    import inspect

    from rolloutd.client import AsyncRolloutClient, RolloutClient

    def public(cls):
        return {n: inspect.signature(f) for n, f in vars(cls).items() if callable(f) and not n.startswith("_")}
    sync, aio = public(RolloutClient), public(AsyncRolloutClient)
    assert set(sync) - {"close"} == set(aio) - {"aclose"}
    for name, sig in sync.items():
        if name != "close":
            assert list(aio[name].parameters) == list(sig.parameters), name
            assert [p.default for p in aio[name].parameters.values()] == [p.default for p in sig.parameters.values()]


# ---------------------------------------------------------------- namespaces


def test_a_client_of_a_namespace_names_its_jobs_there_and_a_document_s_namespace_wins(api, fake):
    from rolloutd.client import Connection

    api.client.namespace = "team-a"  # as RolloutClient(namespace="team-a") or the config's `namespace` set it
    team = "/apis/rolloutd.io/v1alpha1/namespaces/team-a/rolloutjobs"
    fake.on("GET", f"{team}/j", httpx.Response(200, json=obj()))
    fake.on("GET", f"{team}/j/policy", httpx.Response(200, json={"version": 3}))
    fake.on("PUT", f"{team}/j", httpx.Response(201, json=obj()))
    other = "/apis/rolloutd.io/v1alpha1/namespaces/other/rolloutjobs/j"
    fake.on("PUT", other, httpx.Response(201, json=obj()))
    fake.on("GET", P, httpx.Response(200, json={"items": []}))
    assert api("get", "j")["metadata"]["name"] == "j" and api("policy", "j") == {"version": 3}
    api("apply", JOB)
    api("apply", {**JOB, "metadata": {"name": "j", "namespace": "other"}})
    assert len(fake.calls("PUT", f"{team}/j")) == len(fake.calls("PUT", other)) == 1
    assert all(r.headers["x-rolloutd-apply"] == "true" for r in fake.calls("PUT", f"{team}/j"))
    api("list")
    assert fake.calls("GET", P)[0].url.params["fieldSelector"] == "metadata.namespace=team-a"
    assert Connection("http://c", "t").namespace == "default"
