"""Numbers a node daemon sends that no column can hold: refused with a 422 naming their field, or stored as not
counted (NULL), on both stores (the real controller process): never a 500 at every retry nor a job that never ends."""
from __future__ import annotations

import json
import math
import secrets
import time

import pytest

from support.sim.noop import noop_job
from support.waiting import wait_until

from rolloutd.crds.node import NODE_PROTOCOL
from rolloutd.crds.trajectory import Timings, Trajectory

P = "/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs"
ROLLOUTS = 16
NAN, INF = float("nan"), float("inf")
HOSTILE = [NAN, INF, -INF, 1e300, -1e16]  # rewards no mean can take


@pytest.fixture
def job(served) -> str:
    """A fresh job of ROLLOUTS rollouts in the module's controller, named for this test alone."""
    api, source, backends = served
    name = "val-" + secrets.token_hex(4)
    assert api.post(P, json=noop_job(name, source, ROLLOUTS, backends)).status_code == 201
    return name


def _register(api, job: str, **fields):
    return api.post(f"{P}/{job}/nodes/register",
                    json={"job": f"default/{job}", "name": "b0", "protocol": NODE_PROTOCOL, **fields})


@pytest.mark.parametrize("field", ["pid", "slot", "slurmNodeId"])
def test_a_register_number_no_32_bit_column_holds_is_refused_naming_it(controller, job, field):
    """2^40 was a 500 on PostgreSQL (an int4 column), stored on SQLite; 10^30 was already refused (past int64)."""
    for value in (2**40, 10**30, -1):
        r = _register(controller, job, **{field: value})
        assert r.status_code == 422, (value, r.status_code, r.text)
        assert [c["field"] for c in r.json()["details"]["causes"]] == [field], r.text
    r = _register(controller, job, **{field: 2**31 - 1})  # the largest a column holds is stored
    assert r.status_code == 200, r.text
    nodes = controller.get(f"/ui/api/jobs/default/{job}/nodes").json()
    assert nodes["items"] and controller.get(f"{P}/{job}").status_code == 200, nodes


def _leases(api, at: str) -> list[dict]:
    leases: list[dict] = []

    def leased() -> bool:
        r = api.post(f"{at}/lease", json={"maxItems": ROLLOUTS - len(leases), "wait": 2.0})
        r.raise_for_status()
        leases.extend(r.json().get("leases", []))
        return len(leases) >= ROLLOUTS
    wait_until(leased, 60, "every rollout leased")
    return leases


def _result(lease: dict, i: int) -> dict:
    """Every other rollout hostile: a reward from HOSTILE, two stages' seconds 1e308 (a float, but not their sum)."""
    now = time.time()
    stamps = {"init": now - 3, "run": now - 2, "eval": now - 1, "end": now}
    timings = Timings(queue=0.5, init=1.0, run=1.0, eval=1.0, stamps=stamps)
    reward = (i % 4) / 4
    if i % 2:
        reward = HOSTILE[i // 2 % len(HOSTILE)]
        for stage in (("queue", "eval"), ("init", "run"))[i // 2 % 2]:  # the trajectory page's waterfall adds them
            setattr(timings, stage, 1e308)
    t = Trajectory(job="", prompt=lease["prompt"], sample=lease["sample"], finish_reason="stop",
                   attempt=lease["attempt"], timings=timings).wire()
    t["reward"] = reward  # after wire(), which makes NaN and infinities null
    return {"attemptId": lease["attemptId"], "trajectory": t}


def test_rewards_and_seconds_no_sum_can_take_are_not_counted_and_the_job_finishes(controller, job):
    """A NaN reward made PostgreSQL's mean NaN (the job's status failed validation: the job never finished), and
    SQLite's mean counted infinities (infinite, or 0 with both signs). Now the columns hold NULL (the document keeps
    what JSON can: NaN and infinities are null there), and the trajectory page shows no waterfall for two stages of
    1e308 s (their sum was infinite: a 500)."""
    api = controller
    reg = _register(api, job)
    assert reg.status_code == 200, reg.text
    at = f"{P}/{job}/nodes/{reg.json()['nodeId']}"
    leases = _leases(api, at)
    results = [_result(x, i) for i, x in enumerate(leases)]
    nan_seconds = json.dumps({"results": results[:1]}).replace('"queue": 0.5', '"queue": NaN', 1)
    r = api.post(f"{at}/results", content=nan_seconds, headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text  # a stage's seconds are never NaN: refused, naming them
    assert [c["field"] for c in r.json()["details"]["causes"]] == ["results[0].trajectory.timings.queue"], r.text

    r = api.post(f"{at}/results", content=json.dumps({"results": results}),  # json writes NaN and Infinity
                 headers={"content-type": "application/json"})
    assert r.status_code == 200 and len(r.json()["accepted"]) == ROLLOUTS and not r.json()["dropped"], r.text
    wait_until(lambda: api.get(f"{P}/{job}").json()["status"].get("phase") == "Succeeded", 60, "the job to succeed")

    sent = [x["trajectory"]["reward"] for x in results]
    counted = [x for x in sent if abs(x) <= 1e15]
    assert len(counted) == ROLLOUTS // 2
    assert api.get(f"{P}/{job}").json()["status"]["rewardMean"] == round(sum(counted) / len(counted), 4)

    lines = api.get(f"{P}/{job}/trajectories", params={"cursor": 0, "limit": 100}).text.splitlines()
    docs = [json.loads(line) for line in lines if line.strip()]
    assert sorted(map(str, (d["reward"] for d in docs))) == \
        sorted(str(x if math.isfinite(x) else None) for x in sent)  # the document: what JSON holds
    assert api.get(f"{P}/{job}/groups").status_code == 200

    ui = f"/ui/api/jobs/default/{job}"
    page = api.get(f"{ui}/trajectories", params={"limit": 100, "sort": "reward"})
    assert page.status_code == 200, page.text
    assert sorted(map(str, (x["reward"] for x in page.json()["items"]))) == \
        sorted(str(x if abs(x) <= 1e15 else None) for x in sent)
    for path in ("", "/curves", "/nodes"):
        assert api.get(ui + path).status_code == 200, (path, api.get(ui + path).text)
    assert api.get("/ui/api/jobs").status_code == 200
    for x in page.json()["items"]:
        one = api.get(f"{ui}/trajectories/{x['seq']}")
        assert one.status_code == 200, one.text  # no waterfall for seconds no sum can take (two of 1e308 was a 500)
        assert (one.json()["waterfall"] is None) == (x["reward"] is None), one.json()["waterfall"]
