"""A benchmark-only task plug-in (kind `bench-noop`): RUN and EVAL do nothing — no LLM call, no
tool, no sandbox — so a job of it measures the orchestration alone: leases, heartbeats, results,
SQLite and the node daemons' INIT/RUN/EVAL pools. A row with "gate" (a file path) waits in INIT until that file
exists (`bench_outage.py` holds every rollout there while the controller is away).

Registered through the dist-info beside it; `bench_pipeline.py` puts this folder on the
controller's PYTHONPATH (the local executor's daemons inherit it), the way tests/e2e/plugins
registers its scripted tasks. Rows: any JSON object with an "id" (the math rows do).
"""
from __future__ import annotations

import asyncio
import os
from typing import Any, ClassVar

from rolloutd.agents.tasks.base import Reward, TaskHandler
from rolloutd.crds.trajectory import Trajectory


class NoopTask(TaskHandler):
    name: ClassVar[str] = "bench-noop"
    needs_sandbox: ClassVar[bool] = False
    fields: ClassVar[dict] = {"id": (str, int)}
    agent_kinds: ClassVar[tuple[str, ...]] = ("loop", "oracle")   # oracle: a job with no LLM and no tokenizer

    async def init(self, task: dict, sandbox: Any) -> None:
        while task.get("gate") and not os.path.exists(task["gate"]):
            await asyncio.sleep(0.1)

    async def run(self, task: dict, sandbox: Any, llm: Any, *, tokenizer: Any, config: Any, ctx: Any) -> Trajectory:
        return Trajectory(job=ctx.job, prompt=ctx.prompt, sample=ctx.sample, task_id=self.task_id(task),
                          finish_reason="stop")

    async def eval(self, task: dict, sandbox: Any, trajectory: Trajectory) -> Reward:
        return Reward(value=1.0)
