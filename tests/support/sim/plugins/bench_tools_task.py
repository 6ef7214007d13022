"""A benchmark-only task plug-in (kind `bench-tools`): a scripted multi-turn, tool-using episode whose every
generation runs on the real engine, with turn lengths fixed so that a replay can send the very same requests.

Used by `bench/bench_engine_busy.py` (this folder on the controller's PYTHONPATH; the dist-info beside it
registers the kind). Per turn, as the agent loop does it: generate exactly row `tokens` tokens on the pinned
backend (`min_tokens` = `max_tokens`, `ignore_eos`), decode the turn, run one scripted `bash` call in the real
sandbox through the loop's own `tools.execute`, template the observation, append its ids. The policy is
scripted because a small model rarely emits a well-formed tool call; the engine's work is real.
EVAL runs one more command in the sandbox. The trajectory carries `Turn` slices (the replay's prompts) and,
in `metrics.turn_stamps`, each turn's [sent, returned, observation ready] wall-clock stamps.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, ClassVar

from rolloutd.agents.llm import SamplingParams, derive_seed
from rolloutd.agents.tasks.base import Reward, TaskHandler
from rolloutd.agents.loop.tools import ToolCall, execute
from rolloutd.crds.trajectory import Failure, FailureKind, Trajectory, Turn

TURNS, TOKENS = 4, 32  # unless the row says
COMMANDS = ("ls /usr/lib | head -n 12", "echo turn {turn} of {id}; uname -s", "head -n 3 /etc/os-release",
            "printf '%s\\n' $((6 * 7)) $PWD")


class ToolsTask(TaskHandler):
    name: ClassVar[str] = "bench-tools"
    fields: ClassVar[dict] = {"id": (str, int)}

    async def run(self, task: dict, sandbox: Any, llm: Any, *, tokenizer: Any, config: Any, ctx: Any) -> Trajectory:
        t0 = time.monotonic()
        prompt = tokenizer.encode_chat([{"role": "system", "content": "You are an agent with a bash tool."},
                                        {"role": "user", "content": f"Inspect the machine, step {task['id']}."}])
        ids, turns, stamps = list(prompt), [], []
        metrics: dict[str, Any] = {"generated_tokens": 0, "llm_seconds": 0.0, "tool_seconds": 0.0, "turns": 0}
        tokens = int(task.get("tokens", TOKENS))

        async def episode() -> None:
            for turn in range(int(task.get("turns", TURNS))):
                sp = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True,
                                    seed=derive_seed(1, ctx.prompt, ctx.sample, turn))
                sent = time.time()
                gen = await llm.generate(list(ids), sp, f"et-{ctx.job}-p{ctx.prompt}-s{ctx.sample}-t{turn}")
                back = time.time()
                start = len(ids)
                ids.extend(gen.token_ids)
                record = Turn(generated_start=start, generated_end=len(ids), finish_reason=gen.finish_reason)
                turns.append(record)
                tokenizer.decode_content(gen.token_ids)  # what the loop does with every turn
                command = COMMANDS[turn % len(COMMANDS)].format(turn=turn, id=task["id"])
                call = ToolCall("bash", {"command": command})
                record.tool_calls = [call.wire()]
                result = await execute(call, sandbox, config.action_timeout)
                obs = tokenizer.encode_observation(result.observation, closed=False)
                record.observation_start = len(ids)
                ids.extend(obs)
                record.observation_end = len(ids)
                ready = time.time()
                stamps.append([round(sent, 4), round(back, 4), round(ready, 4)])
                metrics["turns"] += 1
                metrics["generated_tokens"] += len(gen.token_ids)
                metrics["llm_seconds"] += back - sent
                metrics["tool_seconds"] += ready - back

        failure = Failure()
        try:
            await asyncio.wait_for(episode(), config.run_timeout)
        except asyncio.TimeoutError:
            failure = Failure(kind=FailureKind.infra, reason=f"RUN stage exceeded {config.run_timeout:g}s")
        metrics["turn_stamps"] = stamps
        metrics["episode_seconds"] = round(time.monotonic() - t0, 4)
        mask = [0] * len(ids)
        for t in turns:
            mask[t.generated_start:t.generated_end] = [1] * (t.generated_end - t.generated_start)
        return Trajectory(job=ctx.job, prompt=ctx.prompt, sample=ctx.sample, task_id=self.task_id(task),
                          token_ids=ids, prompt_length=len(prompt), loss_mask=mask, turns=turns,
                          finish_reason="stop" if failure.kind == FailureKind.none else "error", failure=failure,
                          backend=ctx.backend, metrics=metrics)

    async def eval(self, task: dict, sandbox: Any, trajectory: Trajectory) -> Reward:
        out = await sandbox.bash("test -d / && echo ok")
        return Reward(value=1.0 if "ok" in str(getattr(out, "output", out)) else 0.0)
