"""The RolloutJob models and the generated CRD."""
from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from rolloutd.crds.crd import CRD_PATH, build_crd, render_crd
from rolloutd.crds.rolloutjob import RolloutJob

from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "math-demo.yaml"


def test_issue_spec_is_accepted_exactly_as_written():
    job = RolloutJob.model_validate(yaml.safe_load(EXAMPLE.read_text()))
    assert job.metadata.name == "math-demo"
    assert job.spec.samples_per_prompt == 4
    assert job.spec.sandbox.limits.memory_mb == 1024
    assert job.spec.agent.sampling.max_tokens_per_turn == 256
    assert job.spec.executor.slurm.time_limit == "01:00:00"
    assert job.spec.pipeline.workers_per_node.run == 32
    wire = job.wire()
    assert wire["spec"]["sandbox"]["limits"]["memoryMB"] == 1024  # camelCase on the wire
    assert wire["spec"]["samplesPerPrompt"] == 4


@pytest.mark.parametrize("mutate,field", [
    (lambda d: d["spec"]["agent"].__setitem__("maxTurn", 3), ("spec", "agent", "maxTurn")),
    (lambda d: d["spec"].__setitem__("samplesPerPrompt", "many"), ("spec", "samplesPerPrompt")),
    (lambda d: d["metadata"].__setitem__("name", "Math_Demo"), ("metadata", "name")),
    (lambda d: d["spec"]["executor"]["slurm"].__setitem__("timeLimit", "an hour"), ("spec", "executor", "slurm", "timeLimit")),
    (lambda d: d["spec"]["sandbox"].__setitem__("runtime", "docker"), ("spec", "sandbox", "runtime")),
])
def test_bad_specs_name_the_field(mutate, field):
    doc = yaml.safe_load(EXAMPLE.read_text())
    mutate(doc)
    with pytest.raises(ValidationError) as e:
        RolloutJob.model_validate(doc)
    assert field in [tuple(x["loc"]) for x in e.value.errors()]


def test_crd_is_not_stale():
    assert CRD_PATH.read_text() == render_crd(), "crds/rolloutjob.yaml is stale: run `rolloutd crd`"


def test_crd_schema_is_structural():
    text = yaml.safe_dump(build_crd())
    for forbidden in ("$ref", "anyOf", "$defs", "prefixItems"):
        assert forbidden not in text
    version = build_crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["properties"]["sandbox"]["properties"]["limits"]["properties"]["memoryMB"]["type"] == "integer"
    assert {c["name"] for c in version["additionalPrinterColumns"]} >= {"Phase", "Age"}
