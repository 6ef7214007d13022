"""The token-share rule (issue 36): the controller's per-episode allowance (`controller.work.tokenshare.shares`) and the
node's `TokenGate` (calls held until they fit; a call over the whole allowance goes alone, then holds the gate).

Events, not sleeps: each step waits for the state it needs (a call started, a call held)."""
from __future__ import annotations

import asyncio
import time

from rolloutd.agents.daemon.tokengate import TokenGate
from rolloutd.controller.work.admission import Admission
from rolloutd.controller.work.tokenshare import shares

URL = "http://engine"


def test_shares_split_by_priority_per_episode_and_none_alone():
    adm = Admission(time.time, default=8)
    adm.set_job("ns/a", [URL], None, 30)
    adm.set_job("ns/b", [URL], None, 10)
    for _ in range(4):
        adm.take(URL, "ns/a")
    assert shares(adm, "ns/a", 1000) == {}  # alone on the backend: no cap
    adm.take(URL, "ns/b")
    adm.take(URL, "ns/b")
    assert shares(adm, "ns/a", 1000) == {URL: 750 // 4}  # 3/4 of the budget over its 4 episodes
    assert shares(adm, "ns/b", 1000) == {URL: 250 // 2}
    assert shares(adm, "ns/c", 1000) == {}  # no episode there: nothing to hand out
    adm.give(URL, "ns/b")
    adm.give(URL, "ns/b")
    assert shares(adm, "ns/a", 1000) == {}  # b left: a is alone again


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
    gate.set({})  # the other job left: no cap, the held call goes at once
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


async def _one(gate: TokenGate, cost: int) -> None:
    async with gate.slot(URL, cost):
        pass


def test_a_new_episodes_first_call_waits_for_a_reply_that_counts_it():
    asyncio.run(_fresh())


async def _fresh():
    gate = TokenGate()
    asked: list[int] = []
    gate.ask = lambda: asked.append(1)
    episodes = {URL: 1}
    gate.episodes = lambda url: episodes.get(url, 0)
    gate.set({}, served=True)  # a reply before the episode started: it did not count it
    first = asyncio.create_task(_one(gate, 10))
    while not asked:
        await asyncio.sleep(0)
    assert not first.done() and gate.calls[URL] == 0  # held until the next reply
    gate.set({URL: 100}, served=True)  # the next beat's reply counts it (and shares the backend)
    await asyncio.wait_for(first, 1)
    await asyncio.wait_for(_one(gate, 10), 1)  # counted: no more waiting
    assert len(asked) == 1
    gate.set({}, served=False)  # a controller without token-share: never waits
    episodes[URL] = 5
    await asyncio.wait_for(_one(gate, 10), 1)
    assert len(asked) == 1
