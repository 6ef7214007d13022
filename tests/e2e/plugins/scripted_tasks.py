"""Test-only task plug-ins (registered through the dist-info beside this file, put on PYTHONPATH by
the e2e and Slurm tests): real rollouts against a real engine, with one thing scripted.

- `ScriptedRewards` ("scripted"): EVAL's reward is scripted per prompt, so DAPO's informative /
  non-informative groups are known in advance. Row fields: like math ({"id", "question", "answer"})
  plus "script": "mixed" (reward = sample % 2, an informative group), "right" (all 1) or "wrong" (all 0),
  and optionally "gate" (as below).
- `GatedMath` ("gated"): math, but INIT waits until the file named by the row's "gate" exists. A
  test then knows the job cannot finish before it creates the file (a kill, a restart, an outage
  happens mid-job whatever the machine's speed), and can count the rollouts held at the gate.
"""
import asyncio
import os

from rolloutd.agents.tasks.base import Reward
from rolloutd.agents.tasks.math import MathTask


class GatedMath(MathTask):
    async def init(self, task, sandbox):
        gate = task.get("gate")
        while gate and not os.path.exists(gate):
            await asyncio.sleep(0.1)
        await super().init(task, sandbox)


class ScriptedRewards(GatedMath):
    async def eval(self, task, sandbox, trajectory):
        script = task.get("script", "wrong")
        value = float(trajectory.sample % 2) if script == "mixed" else float(script == "right")
        return Reward(value=value, details={"script": script})
