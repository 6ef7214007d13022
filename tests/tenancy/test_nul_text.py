"""A NUL character in text a node or a client sends is stored, or refused with an answer naming its field, on both
stores (the real controller process). PostgreSQL refuses NUL in text: before, a results call whose failure reason
(tool output) or task id held one failed at every retry, stalling the job that sent it, and a name with %00 in a URL
was answered 500. Now a NUL in text is stored as U+FFFD there (`controller.store.nul_text`); the trajectory's own
document keeps it exactly. A node's name, which its id and so its URLs carry, is refused unless URL-safe. A lone
UTF-16 surrogate's escape (`\\ud800`), which parses to a string that is not Unicode text and so failed the same way on
both stores, is refused with a 400 naming where it is; a pair (an emoji, as Python's json writes it) is text. A policy
version, which an index holds, is bounded so that PostgreSQL's index row can always take it."""
from __future__ import annotations

import json
import secrets

import pytest

from support.sim.noop import noop_job
from support.waiting import wait_until

from rolloutd.crds.node import NODE_PROTOCOL
from rolloutd.crds.trajectory import MAX_VERSION_CHARS, Failure, FailureKind, Trajectory

P = "/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs"
NUL = "\x00"
ROLLOUTS = 16


def _result(lease: dict, i: int) -> dict:
    failure = Failure(kind=FailureKind.agent, reason=f"tool printed {NUL}{NUL} then died") if i % 2 else Failure()
    t = Trajectory(job="", prompt=lease["prompt"], sample=lease["sample"], task_id=f"row{NUL}{i}",
                   finish_reason="stop", reward=None if i % 2 else 1.0, failure=failure, node=f"n{NUL}",
                   attempt=lease["attempt"], policy_version=f"v{NUL}")
    return {"attemptId": lease["attemptId"], "trajectory": t.wire()}


@pytest.fixture
def job(served) -> str:
    """A fresh job of ROLLOUTS rollouts in the module's controller, named for this test alone."""
    api, source, backends = served
    name = "nul-" + secrets.token_hex(4)
    assert api.post(P, json=noop_job(name, source, ROLLOUTS, backends)).status_code == 201
    return name


def test_a_name_with_nul_in_a_url_is_not_found(controller, job):
    for path in (f"{P}/{job}%00", f"{P}/{job}%00/status", f"{P}/{job}%00/trajectories",
                 f"/ui/api/jobs/default/{job}%00"):
        r = controller.get(path)
        assert r.status_code == 404, (path, r.status_code, r.text)
    r = controller.get(f"/ui/api/jobs/default/{job}/trajectories", params={"task": f"r{NUL}", "q": f"x{NUL}"})
    assert r.status_code == 200 and r.json()["items"] == [], r.text


def test_numbers_beyond_int64_in_the_web_uis_routes_are_refused_not_a_500(controller, job):
    """The UI's trajectory list (`after`), one trajectory (its seq) and the node table (`offset`) took any integer:
    2^70 was a 500 on both stores (the database's integer cannot hold it)."""
    huge = str(1 << 70)
    for path, params in (("trajectories", {"after": huge}), (f"trajectories/{huge}", {}), ("trajectories/-1", {}),
                         ("nodes", {"offset": huge})):
        r = controller.get(f"/ui/api/jobs/default/{job}/{path}", params=params)
        assert r.status_code == 422, (path, r.status_code, r.text)
    assert controller.get(f"/ui/api/jobs/default/{job}/trajectories", params={"after": str((1 << 63) - 1)}).json() == \
        {"items": [], "next": None}


@pytest.mark.parametrize("field,value", [("name", f"b{NUL}0"), ("name", "a/b"), ("name", "a?b"), ("host", f"h{NUL}"),
                                         ("slurmJobId", f"1{NUL}")])
def test_a_register_with_a_name_no_url_can_carry_or_a_control_character_is_refused_naming_it(controller, job, field,
                                                                                           value):
    r = controller.post(f"{P}/{job}/nodes/register",
                        json={"job": f"default/{job}", "name": "b0", "protocol": NODE_PROTOCOL, field: value})
    assert r.status_code == 422, r.text
    assert [c["field"] for c in r.json()["details"]["causes"]] == [field], r.text


def test_results_and_reasons_holding_nul_are_accepted_and_the_job_finishes(controller, job):
    api = controller
    reg = api.post(f"{P}/{job}/nodes/register",
                   json={"job": f"default/{job}", "name": "b0", "protocol": NODE_PROTOCOL})
    assert reg.status_code == 200, reg.text
    at = f"{P}/{job}/nodes/{reg.json()['nodeId']}"
    leases: list[dict] = []

    def leased(want: int) -> bool:
        r = api.post(f"{at}/lease", json={"maxItems": want - len(leases), "wait": 2.0})
        r.raise_for_status()
        leases.extend(r.json().get("leases", []))
        return len(leases) >= want
    wait_until(lambda: leased(ROLLOUTS), 60, "every rollout leased")
    long = api.post(f"{at}/return", json={"attemptIds": [leases[0]["attemptId"]], "reason": "x" * 1001})
    assert long.status_code == 422 and [c["field"] for c in long.json()["details"]["causes"]] == ["reason"], long.text
    back = api.post(f"{at}/return", json={"attemptIds": [leases[0]["attemptId"]], "reason": f"sandbox {NUL} lost"})
    assert back.status_code == 200 and back.json()["returned"] == 1, back.text
    wait_until(lambda: leased(ROLLOUTS + 1), 60, "the returned rollout leased again")
    rest = leases[1:]
    beat = api.post(f"{at}/heartbeat", json={"stages": {x["attemptId"]: "run" for x in rest}, "full": True,
                                             "policyVersion": f"v{NUL}"})
    assert beat.status_code == 200 and not beat.json()["cancel"] and not beat.json()["unknown"], beat.text

    results = [_result(x, i) for i, x in enumerate(rest)]
    lone = json.dumps({"results": results}).replace("tool printed", "tool printed \\ud800", 1)
    r = api.post(f"{at}/results", content=lone, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" in r.text, r.text
    assert r.json()["details"]["causes"][0]["field"] == "results[1].trajectory.failure.reason", r.text
    r = api.post(f"{at}/results", content=json.dumps({"results": results}).replace("then died", "then \\ud83d\\udc80"),
                 headers={"content-type": "application/json"})  # ensure_ascii: the emoji as a surrogate pair
    assert r.status_code == 200, r.text
    assert sorted(r.json()["accepted"]) == sorted(x["attemptId"] for x in rest) and not r.json()["dropped"], r.text
    wait_until(lambda: api.get(f"{P}/{job}").json()["status"].get("phase") == "Succeeded", 60, "the job to succeed")

    lines = api.get(f"{P}/{job}/trajectories", params={"cursor": 0, "limit": 100}).text.splitlines()
    docs = [json.loads(line) for line in lines if line.strip()]
    assert sorted(t["taskId"] for t in docs) == sorted(f"row{NUL}{i}" for i in range(ROLLOUTS))  # the document: exact
    assert {t["failure"]["reason"] for t in docs if t["failure"]["kind"] == "agent"} == {f"tool printed {NUL}{NUL} "
                                                                                        "then \U0001f480"}
    page = api.get(f"/ui/api/jobs/default/{job}/trajectories", params={"limit": 100}).json()["items"]
    assert len(page) == ROLLOUTS  # the columns copied out: NUL itself (SQLite) or U+FFFD (PostgreSQL)
    assert {x["reason"] for x in page if x["failure"] == "agent"} <= {f"tool printed {c}{c} then \U0001f480"
                                                                      for c in (NUL, "\ufffd")}
    assert {x["failure"] for x in page} == {"none", "agent"}


def test_a_job_holding_a_lone_surrogate_is_refused_naming_where(controller, served):
    job = noop_job("lone", served[1], ROLLOUTS, ["http://127.0.0.1:9"])
    job["spec"]["agent"]["chatTemplateKwargs"] = {"style": "SURROGATE"}  # a variable's value: any string
    r = controller.post(P, content=json.dumps(job).replace("SURROGATE", "\\udc00"),
                        headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["details"]["causes"][0]["field"] == "spec.agent.chatTemplateKwargs.style", r.text
    assert controller.get(f"{P}/lone").status_code == 404
    assert controller.get(P).status_code == 200  # the namespace's listing is unharmed


def test_a_policy_version_too_long_for_an_index_row_is_refused_naming_it_and_the_longest_allowed_is_stored(
        controller, job):
    """The version is copied into an indexed column: on PostgreSQL a results call whose version's text outgrew an
    index row was a 500 at every retry (its job stalled). Now a version past MAX_VERSION_CHARS is a 422 naming it,
    from a node and from a trainer alike, and the longest allowed, each character one that JSON escapes twice over
    (an emoji), is stored on both stores and streamed back exactly."""
    api = controller
    reg = api.post(f"{P}/{job}/nodes/register",
                   json={"job": f"default/{job}", "name": "b0", "protocol": NODE_PROTOCOL})
    at = f"{P}/{job}/nodes/{reg.json()['nodeId']}"
    leases: list[dict] = []

    def leased() -> bool:
        r = api.post(f"{at}/lease", json={"maxItems": 2 - len(leases), "wait": 2.0})
        leases.extend(r.json().get("leases", []))
        return len(leases) >= 2
    wait_until(leased, 60, "two rollouts leased")
    longest = "\U0001f480" * MAX_VERSION_CHARS
    results = [_result(x, i) for i, x in enumerate(leases)]
    results[1]["trajectory"]["policyVersion"] = secrets.token_hex(MAX_VERSION_CHARS)  # incompressible, 2× too long
    r = api.post(f"{at}/results", json={"results": results})
    assert r.status_code == 422, r.text
    assert [c["field"] for c in r.json()["details"]["causes"]] == ["results[1].trajectory.policyVersion"], r.text
    beat = api.post(f"{at}/heartbeat", json={"stages": {}, "full": False, "policyVersion": longest + "x"})
    assert beat.status_code == 422 and beat.json()["details"]["causes"][0]["field"] == "policyVersion", beat.text
    announce = api.post(f"{P}/{job}/policy", json={"version": 1 << 63})
    assert announce.status_code == 422 and announce.json()["details"]["causes"][0]["field"] == "version", announce.text

    for x in results:
        x["trajectory"]["policyVersion"] = longest
    digits = json.dumps({"results": results}).replace('"metrics": {}', '"metrics": {"n": %s}' % ("1" * 5000), 1)
    r = api.post(f"{at}/results", content=digits, headers={"content-type": "application/json"})  # was a 500
    assert r.status_code == 400 and "cannot be read" in r.json()["message"], r.text
    r = api.post(f"{at}/results", json={"results": results})
    assert r.status_code == 200 and len(r.json()["accepted"]) == 2, r.text
    lines = api.get(f"{P}/{job}/trajectories", params={"cursor": 0, "limit": 100}).text.splitlines()
    assert [json.loads(line)["policyVersion"] for line in lines if line.strip()] == [longest, longest]


def test_counts_no_column_can_hold_are_stored_as_not_counted_and_the_job_finishes(controller, job):
    """The UI's count columns (generated tokens, turns, tool errors) are copied out of a node's metrics or its turns'
    slices: 3·10^9 was a results call failing at every retry on PostgreSQL (a 32-bit column), 10^19 on SQLite too (a
    64-bit integer), 10^400 on both (`math.isfinite` cannot take it), so the job never finished. Now a metric no column holds counts as absent (the turns' slices count instead) and
    a sum of slices no column holds is stored as not counted (NULL); the trajectory's own document keeps every number
    exactly."""
    api = controller
    reg = api.post(f"{P}/{job}/nodes/register",
                   json={"job": f"default/{job}", "name": "b0", "protocol": NODE_PROTOCOL})
    at = f"{P}/{job}/nodes/{reg.json()['nodeId']}"
    leases: list[dict] = []

    def leased() -> bool:
        r = api.post(f"{at}/lease", json={"maxItems": ROLLOUTS - len(leases), "wait": 2.0})
        leases.extend(r.json().get("leases", []))
        return len(leases) >= ROLLOUTS
    wait_until(leased, 60, "every rollout leased")
    huge = [3e9, 10**19, -(2**40), 1e300, 2**31, 10**400]
    results = []
    for i, x in enumerate(leases):
        t = Trajectory(job="", prompt=x["prompt"], sample=x["sample"], finish_reason="stop", reward=1.0,
                       attempt=x["attempt"], metrics={"generated_tokens": huge[i % len(huge)], "turns": 2**33,
                                                      "tool_errors": huge[(i + 1) % len(huge)]} if i % 2 else {},
                       turns=[] if i % 2 else [{"generatedStart": 0, "generatedEnd": 2**62},
                                               {"generatedStart": 0, "generatedEnd": 2**62}])
        results.append({"attemptId": x["attemptId"], "trajectory": t.wire()})
    r = api.post(f"{at}/results", json={"results": results})
    assert r.status_code == 200 and len(r.json()["accepted"]) == ROLLOUTS and not r.json()["dropped"], r.text
    wait_until(lambda: api.get(f"{P}/{job}").json()["status"].get("phase") == "Succeeded", 60, "the job to succeed")
    lines = api.get(f"{P}/{job}/trajectories", params={"cursor": 0, "limit": 100}).text.splitlines()
    docs = [json.loads(line) for line in lines if line.strip()]
    assert sorted(str(d["metrics"].get("generated_tokens")) for d in docs) == \
        sorted(str(json.loads(json.dumps(r["trajectory"]))["metrics"].get("generated_tokens")) for r in results)
    page = api.get(f"/ui/api/jobs/default/{job}/trajectories", params={"limit": 100}).json()["items"]
    assert len(page) == ROLLOUTS
    # metrics past a column: the turns' slices count (none here); slices summing past it: not counted
    assert {(x["generatedTokens"], x["turns"]) for x in page} == {(0, 0), (None, 2)}, page[:2]
