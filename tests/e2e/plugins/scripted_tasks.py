"""A test-only task plug-in (registered through the dist-info beside it, put on PYTHONPATH by the
e2e tests): real rollouts against a real engine, but EVAL's reward is scripted per prompt, so
DAPO's informative / non-informative groups are known in advance.

Row fields: like math ({"id", "question", "answer"}) plus "script": "mixed" (reward = sample % 2,
an informative group), "right" (all 1) or "wrong" (all 0)."""
from rolloutd.agents.tasks.base import Reward
from rolloutd.agents.tasks.math import MathTask


class ScriptedRewards(MathTask):
    async def eval(self, task, sandbox, trajectory):
        script = task.get("script", "wrong")
        value = float(trajectory.sample % 2) if script == "mixed" else float(script == "right")
        return Reward(value=value, details={"script": script})
