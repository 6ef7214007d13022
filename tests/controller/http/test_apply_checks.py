"""A job that could never run is refused at apply, naming the field: a task kind this controller does not know
(it reads the dataset with that kind's handler) and a dataset it cannot read. The rest of the spec checks are in
test_api.py and tests/e2e/test_status_truth.py."""
from __future__ import annotations

import os

import yaml

P = "/apis/rolloutd.io/v1alpha1/rolloutjobs"


def apply(api, example_yaml: str, name: str, **tasks):
    d = yaml.safe_load(example_yaml)
    d["metadata"]["name"] = name
    d["spec"]["tasks"].update(tasks)
    return api.put(f"{P}/{name}", json=d, headers={"X-Rolloutd-Apply": "true"})


def fields(r) -> dict[str, str]:
    return {c["field"]: c["message"] for c in r.json()["details"]["causes"]}


def test_an_unknown_task_kind_is_a_422_naming_it_and_the_known_ones(bad_api, example_yaml):
    r = apply(bad_api, example_yaml, "typo", kind="maths")
    assert r.status_code == 422, r.text
    assert "unknown task kind 'maths'" in fields(r)["spec.tasks.kind"] and "math" in fields(r)["spec.tasks.kind"]
    assert bad_api.get(f"{P}/typo").status_code == 404   # nothing stored, nothing to retry


def test_a_dataset_the_controller_cannot_read_is_a_422_naming_spec_tasks_source(bad_api, example_yaml, tmp_path):
    r = apply(bad_api, example_yaml, "missing", source=str(tmp_path / "nope.jsonl"))
    assert r.status_code == 422 and "no such file" in fields(r)["spec.tasks.source"], r.text
    if os.geteuid() != 0:  # root reads everything
        locked = tmp_path / "locked.jsonl"
        locked.write_text("{}\n")
        locked.chmod(0)
        r = apply(bad_api, example_yaml, "locked", source=str(locked))
        assert r.status_code == 422 and "permission denied" in fields(r)["spec.tasks.source"], r.text
    assert apply(bad_api, example_yaml, "readable").status_code == 201
    bad_api.delete(f"{P}/readable")


def test_handler_options_are_checked_against_the_handler_at_apply(bad_api, example_yaml):
    r = apply(bad_api, example_yaml, "bad-option", options={"requireBoxd": True})
    assert r.status_code == 422 and "require_boxd" in fields(r)["spec.tasks.options"], r.text
    assert apply(bad_api, example_yaml, "boxed", options={"requireBoxed": True}).status_code == 201
    bad_api.delete(f"{P}/boxed")
