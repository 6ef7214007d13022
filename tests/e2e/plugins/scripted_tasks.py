"""Test-only task plug-ins (registered through the dist-info beside this file, put on PYTHONPATH by
the e2e and Slurm tests): real rollouts against a real engine, with one thing scripted.

- `ScriptedRewards` ("scripted"): EVAL's reward is scripted per prompt, so DAPO's informative /
  non-informative groups are known in advance. Row fields: like math ({"id", "question", "answer"})
  plus "script": "mixed" (reward = sample % 2, an informative group), "right" (all 1) or "wrong" (all 0),
  and optionally "gate" (as below) and "infraSample": n (sample n of the group fails in RUN as an
  infrastructure failure, every attempt; the other samples run).
- `GatedMath` ("gated"): math, but INIT waits until the file named by the row's "gate" exists. A
  test then knows the job cannot finish before it creates the file (a kill, a restart, an outage
  happens mid-job whatever the machine's speed), and can count the rollouts held at the gate.
- `ScriptedOracle` ("scripted-oracle"): math rows run by `agent.kind: oracle` (no LLM, no engine) in a bwrap
  sandbox: the answer is the row's own; a row with "script": "infra" fails in RUN as an infrastructure failure,
  every attempt; "gate" as above; a row with "blockInTool": true spends RUN in a bash tool call that sleeps
  (the rollout stalls in a tool call until its job is deleted).
- `ToolFirst` ("tool-first"): math, but RUN starts with one scripted bash tool call in the sandbox (through the
  loop's own `run_tool`), then the real agent loop: a tool call in every rollout, whatever the tiny model says.
"""
import asyncio
import os

from rolloutd.agents.tasks.base import Reward, stash_answer
from rolloutd.crds.trajectory import Trajectory
from rolloutd.agents.tasks.math import MathTask


class GatedMath(MathTask):
    async def init(self, task, sandbox):
        gate = task.get("gate")
        while gate and not os.path.exists(gate):
            await asyncio.sleep(0.1)
        await super().init(task, sandbox)


class ScriptedRewards(GatedMath):
    async def run(self, task, sandbox, llm, *, tokenizer, config, ctx):
        if task.get("infraSample") == ctx.sample:
            raise RuntimeError(f"scripted infrastructure failure of sample {ctx.sample}")
        return await super().run(task, sandbox, llm, tokenizer=tokenizer, config=config, ctx=ctx)

    async def eval(self, task, sandbox, trajectory):
        script = task.get("script", "wrong")
        value = float(trajectory.sample % 2) if script == "mixed" else float(script == "right")
        return Reward(value=value, details={"script": script})


class ScriptedOracle(GatedMath):
    agent_kinds = ("oracle",)
    needs_sandbox = True  # a real bwrap sandbox per rollout, though the oracle runs nothing in it

    async def run(self, task, sandbox, llm, *, tokenizer, config, ctx):
        if task.get("script") == "infra":
            raise RuntimeError("scripted infrastructure failure")
        if task.get("blockInTool"):
            from rolloutd.agents.loop.run import run_tool
            from rolloutd.agents.loop.tools import ToolCall

            await run_tool(ToolCall("bash", {"command": "sleep 600"}), sandbox, 600)
        t = Trajectory(job=ctx.job, prompt=ctx.prompt, sample=ctx.sample, task_id=ctx.task_id, node=ctx.node,
                       attempt=ctx.attempt, finish_reason="oracle", messages=self.messages(task, []))
        return stash_answer(t, submitted=str(task["answer"]), final_text="")


class ToolFirst(MathTask):
    async def run(self, task, sandbox, llm, *, tokenizer, config, ctx):
        from rolloutd.agents.loop.run import run_tool
        from rolloutd.agents.loop.tools import ToolCall

        result = await run_tool(ToolCall("bash", {"command": "echo scripted; exit 3"}), sandbox, 20)
        assert "scripted" in result.observation and not result.ok, result
        return await super().run(task, sandbox, llm, tokenizer=tokenizer, config=config, ctx=ctx)
