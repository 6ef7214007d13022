"""The work-share rule on the node (issue 36): `RateGate` holds a call before it is sent while its job's bucket of
processed tokens per second is in debt (a prompt charged when the call starts, its generated tokens when it ends,
cached prompt tokens given back), at most `MAX_HOLD_SECONDS` of debt but one whole call; the calls in flight
charged when a limit comes; never fails a call; a held call is cancellable;
no limit where the reply gives none (the controller's side: tests/controller/work/test_workshare.py).

A fake clock; each step waits for the state it needs (a call held), then moves the clock and wakes the gate."""
from __future__ import annotations

import asyncio
import json

from rolloutd.agents.daemon.beatbody import beat_body
from rolloutd.agents.daemon.rategate import BURST_SECONDS, MAX_HOLD_SECONDS, RateGate
from rolloutd.crds.node import Heartbeat, HeartbeatResponse

URL = "http://engine"


class Clock:
    def __init__(self) -> None:
        self.t = 50.0

    def __call__(self) -> float:
        return self.t


async def _held(gate: RateGate, n: int) -> None:
    while gate.waiting < n:
        await asyncio.sleep(0)


async def _call(gate: RateGate, prompt: int, generated: int, cached: int | None = None, log: list | None = None):
    async with gate.slot(URL, prompt) as charge:
        if log is not None:
            log.append(prompt)
        charge.done(generated, cached)


def test_a_long_prompt_leaves_its_job_waiting_as_long_as_its_allowance_takes_to_process_it():
    async def go():
        clock = Clock()
        gate = RateGate(clock)
        gate.set({URL: 500.0})
        gate.episodes = lambda url: 2  # two episodes here: 1000 tokens/s for the node
        assert gate.rate(URL) == 1000.0
        await _call(gate, 5000, 100)  # the bucket's burst (2000) lets it go at once; its debt: 3100
        assert gate.level[URL] == 2000 - 5100 and gate.held_calls == 0
        sent: list[int] = []
        second = asyncio.create_task(_call(gate, 10, 5, log=sent))
        await _held(gate, 1)
        assert gate.wait(URL) == 3.1 and gate.wanted[URL] == 10
        clock.t += 3.0
        gate.wake()
        await asyncio.sleep(0)
        assert sent == [] and gate.waiting == 1  # 0.1 s of debt left: still held
        clock.t += 0.1
        gate.wake()
        await second
        assert sent == [10] and gate.held_calls == 1 and abs(gate.held_seconds - 3.1) < 1e-9
        assert gate.waiting == 0 and gate.wanted[URL] == 0
        assert gate.processed[URL] == 5100 + 15
    asyncio.run(go())


def test_a_prompt_worth_more_than_the_window_is_paid_whole():
    async def go():
        clock = Clock()
        gate = RateGate(clock)
        gate.set({URL: 10.0})  # 600 tokens in the window: one 65 536-token prompt is worth 109 windows
        await _call(gate, 65536, 1)
        assert gate.level[URL] == 10.0 * BURST_SECONDS - 65537  # before: capped at 600, 99 % of it forgiven
        assert gate.wait(URL) == (65537 - 20) / 10
    asyncio.run(go())


def test_debt_from_several_calls_is_bounded_by_the_window_so_a_low_allowance_never_starves_the_job():
    async def go():
        gate = RateGate(Clock())
        gate.set({URL: 100.0})  # the window: 100 × MAX_HOLD_SECONDS tokens
        window = 100.0 * MAX_HOLD_SECONDS
        first, second = gate.slot(URL, 100), gate.slot(URL, 100)
        a, b = await first.__aenter__(), await second.__aenter__()  # both start: the bucket was not below zero
        a.done(4000, 0)
        await first.__aexit__(None, None, None)
        assert gate.level[URL] == 200 - 200 - 4000  # each call's own charge is kept whole
        b.done(3000, 0)  # 4000 + 3100 is past the window; neither call alone is
        await second.__aexit__(None, None, None)
        assert gate.level[URL] == -window  # together they are past the window: the rest is forgiven
    asyncio.run(go())


def test_a_limit_that_comes_while_calls_run_charges_their_prompts():
    async def go():
        gate = RateGate(Clock())
        running = gate.slot(URL, 5000)
        charge = await running.__aenter__()  # no limit yet: nothing charged
        assert URL not in gate.level
        gate.set({URL: 100.0})  # the job now shares the backend
        charge.done(10, 0)
        await running.__aexit__(None, None, None)  # it ends before the node's next call asks the gate
        assert gate.level[URL] == 200 - 5010 and gate.processed[URL] == 5010
        assert gate.wait(URL) == (5010 - 200) / 100  # the call was this job's work on the engine
    asyncio.run(go())


def test_cached_prompt_tokens_are_given_back_and_not_counted_as_processed():
    async def go():
        gate = RateGate(Clock())
        gate.set({URL: 1000.0})
        await _call(gate, 3000, 10, cached=2900)
        assert gate.level[URL] == 1000 * BURST_SECONDS - 110
        assert gate.processed[URL] == 110
    asyncio.run(go())


def test_a_held_call_is_cancelled_cleanly_and_a_lifted_limit_releases_the_others():
    async def go():
        clock = Clock()
        gate = RateGate(clock)
        gate.set({URL: 100.0})
        await _call(gate, 10_000, 0)
        doomed = asyncio.create_task(_call(gate, 50, 1))
        sent: list[int] = []
        kept = asyncio.create_task(_call(gate, 70, 1, log=sent))
        await _held(gate, 2)
        doomed.cancel()  # a stale group's cancel, a DAPO cancel: the call was never sent
        await asyncio.gather(doomed, return_exceptions=True)
        assert doomed.cancelled() and gate.waiting == 1 and gate.wanted[URL] == 70
        gate.set({URL: 0})  # the job is alone on the backend again: no limit, no debt kept
        await kept
        assert sent == [70] and URL not in gate.level and gate.processed[URL] == 10_000 + 71
    asyncio.run(go())


def test_no_allowance_means_no_hold_and_the_wire_carries_the_counts_only_when_served():
    async def go():
        gate = RateGate(Clock())
        for _ in range(3):
            await _call(gate, 100_000, 10)
        assert gate.held_calls == 0 and gate.processed[URL] == 300_030
        return gate.report()
    processed, held = asyncio.run(go())
    hb = Heartbeat(llm_processed=processed, llm_rate_held=held)
    assert "llmProcessed" not in json.loads(beat_body(hb, [], deltas=True))
    sent = json.loads(beat_body(hb, [], deltas=True, work=True))
    assert sent["llmProcessed"] == {URL: 300_030} and sent["llmRateHeld"] == [0.0, 0.0]
    assert HeartbeatResponse.model_validate({"llmRates": {URL: 12.5}}).llm_rates == {URL: 12.5}
