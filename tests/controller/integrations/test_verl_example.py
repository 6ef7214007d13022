"""The verl adapter's pieces that need no verl: the job's dataset as verl's rows (the prompt index kept in
`extra_info.index`), and the worked example in examples/verl/ (a valid batch job; the registry entry names the
agent loop that exists). tests/rl/test_verl_agent_loop.py runs the loop itself under verl."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rolloutd.crds.rolloutjob import RolloutJob
from rolloutd.integrations.verl import to_verl_rows

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "verl"


def test_rows_keep_their_index_and_select_the_rolloutd_loop():
    rows = to_verl_rows([{"id": "a", "question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}])
    assert [r["extra_info"]["index"] for r in rows] == [0, 1] and {r["agent_name"] for r in rows} == {"rolloutd"}
    assert rows[0]["prompt"] == [{"role": "user", "content": "1+1?"}] and rows[1]["reward_model"]["ground_truth"] == "4"
    with pytest.raises(KeyError, match="row 1 has no 'question'"):
        to_verl_rows([{"question": "?"}, {"prompt": "?"}])


def test_the_worked_example_is_a_batch_job_and_names_the_agent_loop():
    job = RolloutJob.model_validate(yaml.safe_load((EXAMPLE / "job.yaml").read_text()))
    assert job.spec.batch_mode
    (entry,) = yaml.safe_load((EXAMPLE / "agent_loops.yaml").read_text())
    assert entry["name"] == "rolloutd" and entry["job"] == job.metadata.name
    module, cls = entry["_target_"].rsplit(".", 1)
    source = (REPO / "controller" / "integrations" / "verl" / f"{module.rsplit('.', 1)[1]}.py").read_text()
    assert module == "rolloutd.integrations.verl.agent_loop" and f"class {cls}(" in source
    script = (EXAMPLE / "run_verl.sh").read_text()
    assert "agent_loop_config_path=examples/verl/agent_loops.yaml" in script
    assert "checkpoint_manager_class=rolloutd.integrations.verl.checkpoint.RolloutdCheckpointManager" in script
    assert f"rollout.n={job.spec.samples_per_prompt}" in script
