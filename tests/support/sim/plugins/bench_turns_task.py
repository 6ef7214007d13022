"""A benchmark-only task plug-in (kind `bench-turns`): RUN is a fixed multi-turn episode against the pinned
backend (row `turns` calls of exactly row `tokens` tokens each, the context growing), no sandbox, no grading.
A row with `prompt_tokens` makes each call a fresh prompt of that many random ids instead (no prefix the engine
has cached), cut to the job's token budget as the harness gateway cuts it (`maxTotalTokens` - `tokens`): the
heaviest calls a harness may send a shared engine, one at a time (`bench_fairshare`'s worst legal job).

Registered through the dist-info beside it; `bench_admission.py` puts this folder on the controller's PYTHONPATH
(its local daemons inherit it). RUN is bounded by `timeouts.runSeconds` like the agent loop: an episode whose
turns wait too long in the engine's queue ends as an infrastructure failure ("RUN stage exceeded").
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import Any, ClassVar

from rolloutd.agents.llm import SamplingParams
from rolloutd.agents.tasks.base import Reward, TaskHandler
from rolloutd.crds.trajectory import Failure, FailureKind, Trajectory

TURNS, TOKENS = 3, 16  # unless the row says


class TurnsTask(TaskHandler):
    name: ClassVar[str] = "bench-turns"
    needs_sandbox: ClassVar[bool] = False
    fields: ClassVar[dict] = {"id": (str, int)}

    async def run(self, task: dict, sandbox: Any, llm: Any, *, tokenizer: Any, config: Any, ctx: Any) -> Trajectory:
        ids = tokenizer.encode_chat([{"role": "user", "content": f"Tell a short story about the number {task['id']}."}])
        t0 = time.monotonic()

        async def turns() -> None:
            nonlocal ids
            tokens = task.get("tokens", TOKENS)
            fresh = task.get("prompt_tokens")
            rng = random.Random(f"{ctx.job}/{ctx.prompt}/{ctx.sample}/{ctx.attempt}")
            for turn in range(task.get("turns", TURNS)):
                if fresh:  # the longest prompt the budget leaves room for, never seen by the engine before
                    n = min(fresh, config.max_total_tokens - tokens)
                    ids = [rng.randrange(16, tokenizer.vocab_size) for _ in range(n)]
                sp = SamplingParams(max_tokens=tokens, min_tokens=tokens, seed=ctx.prompt * 10 + turn)
                gen = await llm.generate(list(ids), sp, f"bt-{ctx.job}-p{ctx.prompt}-s{ctx.sample}-t{turn}")
                ids = ids + gen.token_ids + tokenizer.encode_observation("go on")

        failure = Failure()
        try:
            await asyncio.wait_for(turns(), config.run_timeout)
        except asyncio.TimeoutError:
            failure = Failure(kind=FailureKind.infra, reason=f"RUN stage exceeded {config.run_timeout:g}s")
        return Trajectory(job=ctx.job, prompt=ctx.prompt, sample=ctx.sample, task_id=self.task_id(task),
                          finish_reason="stop" if failure.kind == FailureKind.none else "error", failure=failure,
                          metrics={"episode_seconds": round(time.monotonic() - t0, 3)})

    async def eval(self, task: dict, sandbox: Any, trajectory: Trajectory) -> Reward:
        return Reward(value=1.0)
