"""The node's queued prefill (issue 36): `PrefillGate` lets one long prompt of the node await its prefill per backend;
the node's next long prompt goes at that one's first token or end (however it ends); short prompts and other backends
never wait. Each step waits for the state it needs (a call held), never for time. On the real engine:
test_prefill_gate_engine.py."""
from __future__ import annotations

import asyncio

import pytest

from rolloutd.agents.daemon.prefillgate import LONG_PROMPT_TOKENS, PrefillGate

URL, OTHER = "http://engine", "http://other"
LONG = LONG_PROMPT_TOKENS + 1


async def _held(gate: PrefillGate, n: int) -> None:
    while gate.waiting < n:
        await asyncio.sleep(0)


def test_the_next_long_prompt_goes_at_the_first_token_of_the_one_before():
    async def go():
        gate, sent = PrefillGate(), []
        first_token, end = asyncio.Event(), asyncio.Event()

        async def first():
            async with gate.slot(URL, LONG) as prefilled:
                sent.append("first")
                await first_token.wait()
                prefilled()
                await end.wait()  # still decoding: the turn has passed on

        async def second():
            async with gate.slot(URL, LONG):
                sent.append("second")

        a = asyncio.create_task(first())
        await asyncio.sleep(0)
        b = asyncio.create_task(second())
        await _held(gate, 1)
        assert sent == ["first"]
        first_token.set()
        await b
        assert sent == ["first", "second"] and gate.held == 1 and gate.waiting == 0
        end.set()
        await a

    asyncio.run(go())


def test_short_prompts_and_other_backends_never_wait():
    async def go():
        gate = PrefillGate()
        async with gate.slot(URL, LONG):
            async with gate.slot(URL, LONG_PROMPT_TOKENS):  # not past the threshold
                pass
            async with gate.slot(OTHER, LONG):
                pass
            async with gate.slot(None, LONG):  # no backend known: nothing to queue at
                pass
        assert gate.held == 0

    asyncio.run(go())


def test_a_call_that_fails_or_is_cancelled_passes_the_turn_on():
    async def go():
        gate = PrefillGate()
        with pytest.raises(RuntimeError):
            async with gate.slot(URL, LONG):
                raise RuntimeError("the engine refused it")
        async with gate.slot(URL, LONG):  # not blocked by the failed one
            waiter = asyncio.create_task(gate.slot(URL, LONG).__aenter__())
            await _held(gate, 1)
            waiter.cancel()  # a held call is cancelled like any other await
            with pytest.raises(asyncio.CancelledError):
                await waiter
        assert gate.waiting == 0
        async with gate.slot(URL, LONG):  # the cancelled one left no turn behind
            pass

    asyncio.run(go())
