"""The token-share rule on the node (issue 36): `TokenGate` holds calls until they fit the allowance a beat's reply
gave (a call over the whole allowance goes alone, then holds the gate), reports its demand on beats, and waits for a
reply only the first time it hears of a backend (the controller's side: tests/controller/work/test_tokenshare.py).

Events, not sleeps: each step waits for the state it needs (a call started, a call held)."""
from __future__ import annotations

import asyncio
import time

import json

from rolloutd.agents.daemon.beatbody import beat_body
from rolloutd.agents.daemon import tokengate
from rolloutd.agents.daemon.tokengate import TokenGate
from rolloutd.crds.node import Heartbeat

URL = "http://engine"


async def _started(gate: TokenGate, calls: int) -> None:
    while gate.calls[URL] < calls:
        await asyncio.sleep(0)


def test_calls_wait_for_room_and_an_oversized_call_goes_alone():
    asyncio.run(_test_calls_wait_for_room_and_an_oversized_call_goes_alone())


async def _test_calls_wait_for_room_and_an_oversized_call_goes_alone():
    gate = TokenGate()
    gate.set({URL: 100})
    release = [asyncio.Event() for _ in range(3)]
    order: list[int] = []

    async def call(i: int, cost: int) -> None:
        async with gate.slot(URL, cost):
            order.append(i)
            await release[i].wait()

    first = asyncio.create_task(call(0, 60))
    await _started(gate, 1)
    second = asyncio.create_task(call(1, 60))  # 60 + 60 > 100: held
    while gate.waiting < 1:
        await asyncio.sleep(0)
    assert order == [0] and gate.in_flight[URL] == 60
    release[0].set()
    await first
    await _started(gate, 1)
    assert order == [0, 1]
    release[1].set()
    await second
    assert gate.hold_until.get(URL) is None  # calls within the allowance leave no hold
    big = asyncio.create_task(call(2, 400))  # larger than the whole allowance: goes alone, at once
    await _started(gate, 1)
    assert gate.waiting == 0
    release[2].set()
    await big
    assert gate.hold_until[URL] >= time.monotonic()  # held ≈ its time × (400/100 − 1) after it


def test_the_hold_after_an_oversized_call_and_a_lifted_cap():
    asyncio.run(_test_the_hold_after_an_oversized_call_and_a_lifted_cap())


async def _test_the_hold_after_an_oversized_call_and_a_lifted_cap():
    gate = TokenGate()
    gate.set({URL: 100})
    t0 = time.monotonic()
    async with gate.slot(URL, 300):
        await asyncio.sleep(0.05)
    t1 = time.monotonic()
    # held its time in flight × (300/100 − 1) after it ended
    assert t0 + 0.05 + 2 * 0.05 <= gate.hold_until[URL] <= t1 + 2 * (t1 - t0)
    waiter = asyncio.create_task(_one(gate, 10))
    while gate.waiting < 1:
        await asyncio.sleep(0)
    gate.set({URL: 0})  # the other job left: no cap (0), the held call goes at once
    await asyncio.wait_for(waiter, 1)
    assert gate.held == 1


def test_allowance_grows_with_the_nodes_episodes_and_no_url_is_never_held():
    asyncio.run(_test_allowance_grows_with_the_nodes_episodes_and_no_url_is_never_held())


async def _test_allowance_grows_with_the_nodes_episodes_and_no_url_is_never_held():
    gate = TokenGate()
    gate.set({URL: 100})
    gate.episodes = lambda url: 3
    assert gate.allowance(URL) == 300 and gate.allowance("http://other") is None
    async with gate.slot(URL, 150), gate.slot(URL, 150):  # 300 fits three episodes' part
        assert gate.waiting == 0 and gate.in_flight[URL] == 300
    async with gate.slot(None, 10**6):
        pass


async def _one(gate: TokenGate, cost: int, url: str = URL) -> None:
    async with gate.slot(url, cost):
        pass


def test_a_call_waits_for_a_reply_only_the_first_time_the_node_hears_of_its_backend(monkeypatch):
    asyncio.run(_first_time(monkeypatch))


async def _first_time(monkeypatch):
    gate = TokenGate()
    asked: list[int] = []
    gate.ask = lambda: asked.append(1)
    episodes = {URL: 1}
    gate.episodes = lambda url: episodes.get(url, 0)
    gate.set({URL: 0}, served=True)  # the reply names URL (alone there: no cap), before any episode
    for n in (1, 5):  # new episodes on a named backend: no wait, no beat asked
        episodes[URL] = n
        await asyncio.wait_for(_one(gate, 10), 1)
    assert asked == []
    other = "http://other"
    first = asyncio.create_task(_one(gate, 10, other))  # a backend no reply named: waits for one
    while not asked:
        await asyncio.sleep(0)
    assert not first.done() and gate.calls[other] == 0
    gate.set({URL: 0, other: 100}, served=True)  # the next reply names it
    await asyncio.wait_for(first, 1)
    await asyncio.wait_for(_one(gate, 10, other), 1)
    assert len(asked) == 1
    third = "http://third"  # no reply names it: one bounded wait, then the node goes on what it knows
    monkeypatch.setattr(tokengate, "FRESH_SECONDS", 0.05)  # (that wait, shortened)
    await asyncio.wait_for(_one(gate, 10, third), 1)
    assert len(asked) == 2
    await asyncio.wait_for(_one(gate, 10, third), 1)
    assert len(asked) == 2
    fresh = TokenGate()
    fresh.ask = lambda: asked.append(1)
    fresh.set({}, served=False)  # a controller without token-share: never waits, never capped
    await asyncio.wait_for(_one(fresh, 10**6, "http://any"), 1)
    assert len(asked) == 2


def test_a_beat_reports_tokens_in_flight_and_held_only_when_token_share_is_served():
    asyncio.run(_report())


async def _report():
    gate = TokenGate()
    gate.set({URL: 100})
    release = asyncio.Event()

    async def call(cost: int) -> None:
        async with gate.slot(URL, cost):
            await release.wait()

    first = asyncio.create_task(call(60))
    await _started(gate, 1)
    second = asyncio.create_task(call(70))  # 60 + 70 > 100: held, and reported as wanted
    while gate.waiting < 1:
        await asyncio.sleep(0)
    assert gate.report() == {URL: 130}
    hb = Heartbeat(llm_tokens=gate.report())
    assert json.loads(beat_body(hb, [], deltas=True, tokens=True))["llmTokens"] == {URL: 130}
    assert "llmTokens" not in json.loads(beat_body(hb, [], deltas=True))  # an older controller refuses the field
    release.set()
    await asyncio.gather(first, second)
    assert gate.report() == {}
