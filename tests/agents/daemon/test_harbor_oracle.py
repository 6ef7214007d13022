"""An `agent.kind: oracle` job of Harbor tasks through the real node daemon (fake controller): no LLM,
no tokenizer; INIT builds or reuses each task's image and starts the sandbox in it; every task
scores 1 and no sandbox is left behind. Images are cached (tests/agents/tasks/test_harbor.py builds them)."""
from __future__ import annotations

import asyncio
import copy
import shutil
from pathlib import Path

import pytest

from support.node_helpers import BASE_SPEC, options
from rolloutd.agents.daemon.daemon import NodeDaemon
from rolloutd.agents.tasks.harbor import HarborTask
from rolloutd.crds.trajectory import Trajectory

TASKS = Path(__file__).resolve().parents[3] / "examples" / "harbor" / "tasks"


def test_oracle_job_scores_every_harbor_task_1(controller, sandbox_dir):
    if shutil.which("mmdebstrap") is None:
        pytest.skip("mmdebstrap is needed to build the images (bash .ci/system-packages.sh)")
    spec = copy.deepcopy(BASE_SPEC)
    del spec["llm"]
    spec["tasks"] = {"kind": "harbor", "source": str(TASKS)}
    spec["agent"] = {"kind": "oracle", "tools": []}
    spec["timeouts"] = {"initSeconds": 900, "runSeconds": 120, "evalSeconds": 120}
    fake = controller(spec)
    handler = HarborTask()
    rows = handler.load(TASKS)
    fake.add(*rows)

    code = asyncio.run(asyncio.wait_for(NodeDaemon(options(fake), handler=handler).run(), 1200))
    assert code == 0 and len(fake.accepted) == len(rows) == 3
    for wire in fake.accepted.values():
        t = Trajectory.model_validate(wire)
        assert (t.failure.kind.value, t.reward) == ("none", 1.0), (t.task_id, t.failure, t.reward_details)
        assert t.finish_reason == "oracle" and t.metrics["oracle_exit"] == 0
    assert list(sandbox_dir.iterdir()) == []
