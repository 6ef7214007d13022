"""Numbers in API requests that no column or index can hold are refused with a 400/422 naming the field, on both stores
(the real controller process): before, PostgreSQL's 32/64-bit columns turned them into 500s or they were taken."""
from __future__ import annotations

import secrets

import pytest

from support.sim.noop import noop_job

from rolloutd.crds.rolloutjob import MAX_BATCHES, MAX_GROUPS

P = "/apis/rolloutd.io/v1alpha1/namespaces/default/rolloutjobs"
INT64_MAX = (1 << 63) - 1


def _doc(served, **spec) -> dict:
    _, source, backends = served
    doc = noop_job("v-" + secrets.token_hex(4), source, 32, backends)
    doc["spec"].update(spec)
    return doc


@pytest.fixture
def batch_job(served) -> str:
    """A fresh batch job (a batch of one group), named for this test alone."""
    doc = _doc(served, batches={"groups": 1})
    assert served[0].post(P, json=doc).status_code == 201
    return doc["metadata"]["name"]


def _fields(r) -> list[str]:
    return [c["field"] for c in r.json()["details"]["causes"]]


@pytest.mark.parametrize("k", [-1, MAX_BATCHES + 1, 1 << 40, INT64_MAX])
def test_a_batch_number_past_the_column_in_the_path_is_a_400_naming_it(controller, batch_job, k):
    """`GET …/batches/-1` was a 404 (no such batch), 2^31 and past a 500 on PostgreSQL (a 32-bit column)."""
    r = controller.get(f"{P}/{batch_job}/batches/{k}")
    assert r.status_code == 400 and _fields(r) == ["path.k"], r.text
    assert "path.k" in r.json()["message"], r.text
    assert controller.get(f"{P}/{batch_job}/batches/{MAX_BATCHES}").status_code == 404  # the largest: none yet


@pytest.mark.parametrize("k", [-1, MAX_BATCHES + 1, 1 << 40])
def test_a_batch_number_past_the_column_in_the_body_is_a_422_naming_it(controller, batch_job, k):
    r = controller.post(f"{P}/{batch_job}/batches", json={"batch": k})
    assert r.status_code == 422 and _fields(r) == ["batch"], r.text
    assert "batch" in r.json()["message"], r.text


@pytest.mark.parametrize("spec,field", [
    ({"batches": {"groups": MAX_GROUPS + 1}}, "spec.batches.groups"),
    ({"batches": {"groups": 1, "maxInFlightGroups": MAX_GROUPS + 1}}, "spec.batches.maxInFlightGroups"),
    ({"batches": {"groups": 1, "count": 1 << 31}}, "spec.batches.count"),
    ({"dapo": {"enabled": True, "targetGroups": MAX_GROUPS + 1}}, "spec.dapo.targetGroups"),
    ({"dapo": {"enabled": True, "maxInFlightGroups": 2 * MAX_GROUPS + 1}}, "spec.dapo.maxInFlightGroups"),
])
def test_a_batch_size_past_what_the_scheduler_counts_is_a_422_naming_it(controller, served, spec, field):
    """Accepted before: the scheduler's counts (groups × samples a prompt) outgrew PostgreSQL's 32-bit columns."""
    r = controller.post(P, json=_doc(served, **spec))
    assert r.status_code == 422 and _fields(r) == [field], r.text
    assert field in r.json()["message"], r.text


@pytest.mark.parametrize("spec", [{"batches": {"groups": MAX_GROUPS, "maxInFlightGroups": MAX_GROUPS,
                                               "count": (1 << 31) - 1}},
                                  {"dapo": {"enabled": True, "targetGroups": MAX_GROUPS,
                                            "maxInFlightGroups": 2 * MAX_GROUPS}}])
def test_the_largest_batch_sizes_are_taken(controller, served, spec):
    assert controller.post(P, json=_doc(served, **spec)).status_code == 201


@pytest.mark.parametrize("cursor", [1 << 31, 1 << 40, INT64_MAX])
def test_a_trajectories_cursor_up_to_int64_reads_nothing_past_it(controller, batch_job, cursor):
    """2^31 and past were a 500 on PostgreSQL: the parameter was cast to the 32-bit seq column's type."""
    r = controller.get(f"{P}/{batch_job}/trajectories", params={"cursor": cursor})
    assert r.status_code == 200 and r.text == "", r.text


@pytest.mark.parametrize("cursor", [-1, 1 << 63, 1 << 70])
def test_a_trajectories_cursor_past_int64_is_a_400_naming_it(controller, batch_job, cursor):
    r = controller.get(f"{P}/{batch_job}/trajectories", params={"cursor": cursor})
    assert r.status_code == 400 and _fields(r) == ["query.cursor"], r.text


@pytest.mark.parametrize("rv", [1 << 31, 1 << 40, INT64_MAX])
def test_a_watch_from_a_resource_version_up_to_int64_is_answered(controller, batch_job, rv):
    """2^31 and past were a 500 on PostgreSQL: the parameter was cast to the 32-bit rv column's type."""
    for one in ({}, {"fieldSelector": f"metadata.name={batch_job}"}):  # the whole log, and one job's changes
        r = controller.get(P, params={"watch": "true", "resourceVersion": str(rv), "timeoutSeconds": "0.5", **one})
        assert r.status_code == 200 and r.text == "", (one, r.text)


@pytest.mark.parametrize("rv", ["-1", str(1 << 63), str(1 << 70)])
def test_a_resource_version_past_int64_is_a_400_naming_it(controller, batch_job, rv):
    r = controller.get(P, params={"watch": "true", "resourceVersion": rv, "timeoutSeconds": "0.5"})
    assert r.status_code == 400 and _fields(r) == ["resourceVersion"], r.text
