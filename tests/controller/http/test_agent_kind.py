"""agent.kind: the oracle job omits `llm`; any other agent without `llm.tokenizer` is refused naming the field."""
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from rolloutd.crds.rolloutjob import RolloutJob

ROOT = Path(__file__).resolve().parents[3]


def test_the_harbor_oracle_example_needs_no_llm():
    job = RolloutJob.model_validate(yaml.safe_load((ROOT / "examples/harbor/oracle-job.yaml").read_text()))
    assert job.spec.agent.kind == "oracle" and job.spec.llm.tokenizer is None and job.spec.llm.backends == []


@pytest.mark.parametrize("agent", [{}, {"kind": "loop"}])
def test_an_llm_agent_without_llm_names_the_field(agent):
    doc = yaml.safe_load((ROOT / "examples/harbor/oracle-job.yaml").read_text())
    doc["spec"]["agent"] = agent
    with pytest.raises(ValidationError) as e:
        RolloutJob.model_validate(doc)
    [error] = e.value.errors()
    assert error["loc"] == ("spec", "llm") and "llm.tokenizer is required" in error["msg"]


def test_unknown_agent_kind_is_refused():
    doc = yaml.safe_load((ROOT / "examples/harbor/oracle-job.yaml").read_text())
    doc["spec"]["agent"]["kind"] = "harness-x"
    with pytest.raises(ValidationError) as e:
        RolloutJob.model_validate(doc)
    assert ("spec", "agent", "kind") in [tuple(x["loc"]) for x in e.value.errors()]


def test_the_api_answers_422_naming_spec_llm(bad_api):
    doc = yaml.safe_load((ROOT / "examples/harbor/oracle-job.yaml").read_text())
    doc["spec"]["agent"] = {"kind": "loop"}
    r = bad_api.put(f"/apis/rolloutd.io/v1alpha1/rolloutjobs/{doc['metadata']['name']}", json=doc)
    assert r.status_code == 422, r.text
    assert [c["field"] for c in r.json()["details"]["causes"]] == ["spec.llm"]
    assert "llm.tokenizer is required" in r.json()["message"]


@pytest.mark.parametrize("agent, message", [
    ({"kind": "harness"}, "agent.kind harness needs agent.command"),
    ({"kind": "harness", "command": "  "}, "agent.kind harness needs agent.command"),
    ({"kind": "loop", "command": "mini"}, "agent.command is only for agent.kind harness"),
])
def test_harness_command_rules(agent, message):
    doc = yaml.safe_load((ROOT / "examples/harbor/oracle-job.yaml").read_text())
    doc["spec"]["agent"] = agent
    doc["spec"]["llm"] = {"tokenizer": "models/x"}
    with pytest.raises(ValidationError) as e:
        RolloutJob.model_validate(doc)
    assert [(x["loc"], message in x["msg"]) for x in e.value.errors()] == [(("spec", "agent", "command"), True)]


def test_a_harness_job_needs_the_llm():
    doc = yaml.safe_load((ROOT / "examples/harbor/oracle-job.yaml").read_text())
    doc["spec"]["agent"] = {"kind": "harness", "command": "my-agent --task-file $ROLLOUTD_INSTRUCTION_FILE"}
    with pytest.raises(ValidationError, match="llm.tokenizer is required: agent.kind 'harness'"):
        RolloutJob.model_validate(doc)
    doc["spec"]["llm"] = {"tokenizer": "models/x", "backends": [{"url": "http://127.0.0.1:8000"}]}
    assert RolloutJob.model_validate(doc).spec.agent.command.startswith("my-agent")


def test_the_harness_example_is_valid():
    job = RolloutJob.model_validate(yaml.safe_load((ROOT / "examples/harbor/harness-job.yaml").read_text()))
    assert job.spec.agent.kind == "harness" and job.spec.llm.tokenizer


def test_the_api_answers_422_naming_a_chat_template_argument_rolloutd_sets(bad_api):
    doc = yaml.safe_load((ROOT / "examples/math-demo.yaml").read_text())
    doc["spec"]["agent"]["chatTemplateKwargs"] = {"enable_thinking": False, "add_generation_prompt": False}
    r = bad_api.put(f"/apis/rolloutd.io/v1alpha1/rolloutjobs/{doc['metadata']['name']}", json=doc)
    assert r.status_code == 422, r.text
    [cause] = r.json()["details"]["causes"]
    assert cause["field"] == "spec.agent.chatTemplateKwargs" and "add_generation_prompt: set by rolloutd" in \
        cause["message"], cause
