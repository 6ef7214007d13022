"""`TrackedLLM`'s per-token versions, as a unit: a scripted stream stands in for the engine (the proof against the real
engine is tests/e2e/test_async_updates.py). Keep mode: the fence marks where a stream stood while the engines were
paused; abort mode: an aborted stream's tokens are kept and the rest resubmitted from prompt + those tokens."""
from __future__ import annotations

import asyncio

import pytest

from rolloutd.agents.daemon.llmgate import QUIET_SECONDS, PolicyGate, TrackedLLM
from rolloutd.agents.llm import BackendError, Generation, Preempted, SamplingParams


class Scripted:
    """Streams token 1, 2, 3, ...; `hold` stops it (an engine paused), `abort` ends it with an abort chunk."""

    def __init__(self) -> None:
        self.hold = asyncio.Event()
        self.hold.set()
        self.abort_now = asyncio.Event()
        self.prompts: list[list[int]] = []

    async def stream(self, prompt_ids, sampling: SamplingParams, request_id):
        self.prompts.append(list(prompt_ids))
        yield Generation([], [], "", None)
        for i in range(sampling.max_tokens):
            await self.hold.wait()
            if self.abort_now.is_set():
                self.abort_now.clear()
                raise Preempted("aborted", Generation([], [], "abort"))
            await asyncio.sleep(0.001)
            done = i == sampling.max_tokens - 1
            yield Generation([len(prompt_ids) + 1], [-0.5], "length" if done else "")

    async def generate(self, prompt_ids, sampling, request_id):  # drain mode
        return Generation([7] * sampling.max_tokens, [-0.1] * sampling.max_tokens, "length", list(prompt_ids))

    async def abort(self, request_id):
        pass


async def wait_for(pred, what: str):
    for _ in range(2000):
        if pred():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(what)


def test_keep_mode_fence_splits_where_the_stream_stood_when_the_engine_paused():
    async def go():
        gate, engine = PolicyGate(version=1), Scripted()
        gate.mode = "keep"
        llm = TrackedLLM(engine, gate, mode="keep", url="http://b")
        task = asyncio.create_task(llm.generate([0, 0], SamplingParams(max_tokens=40), "r"))
        await wait_for(lambda: gate.streams and next(iter(gate.streams)).received >= 10, "tokens")
        gate.set(1, paused=True)           # hold new calls
        engine.hold.clear()                # the engine paused with the request in place
        gate.set(1, paused=True, fence=1)  # the controller asks for the fence
        await wait_for(lambda: gate.fence_done == 1, "the fence")
        at = next(iter(gate.streams)).marks[0]
        gate.set(2, paused=False)          # loaded, resumed
        engine.hold.set()
        gen = await task
        assert gen.versions == [(1, at), (2, 40 - at)] and 10 <= at < 40
        assert llm.versions == [1]
    asyncio.run(go())


def test_fence_waits_for_tokens_still_arriving():
    async def go():
        gate, engine = PolicyGate(version=1), Scripted()
        llm = TrackedLLM(engine, gate, mode="keep", url="http://b")
        task = asyncio.create_task(llm.generate([0], SamplingParams(max_tokens=400), "r"))
        await wait_for(lambda: gate.streams and next(iter(gate.streams)).received >= 5, "tokens")
        gate.set(1, paused=True, fence=1)  # the engine still streams: the fence must not be taken yet
        await asyncio.sleep(QUIET_SECONDS / 2)
        assert gate.fence_done == 0
        engine.hold.clear()
        await wait_for(lambda: gate.fence_done == 1, "the fence")
        s = next(iter(gate.streams))
        assert s.marks == [s.received]
        at = s.received
        gate.set(2, paused=False)
        engine.hold.set()
        gen = await task
        assert gen.versions == [(1, at), (2, 400 - at)]
    asyncio.run(go())


def test_abort_mode_keeps_the_tokens_and_continues_from_prompt_plus_them():
    async def go():
        gate, engine = PolicyGate(version=1), Scripted()
        llm = TrackedLLM(engine, gate, mode="abort", url="http://b")
        task = asyncio.create_task(llm.generate([0, 0], SamplingParams(max_tokens=30), "r"))
        await wait_for(lambda: gate.streams and next(iter(gate.streams)).received >= 8, "tokens")
        gate.set(1, paused=True)
        engine.abort_now.set()
        await wait_for(lambda: len(engine.prompts) == 1 and not engine.abort_now.is_set(), "the abort")
        kept = next(iter(gate.streams)).received
        gate.set(2, paused=False, backend_versions={})
        gen = await task
        assert gen.versions == [(1, kept), (2, 30 - kept)]
        assert engine.prompts[1] == [0, 0] + gen.token_ids[:kept]  # resubmitted: prompt + the tokens so far
        assert len(gen.token_ids) == len(gen.logprobs) == 30
    asyncio.run(go())


def test_a_backend_that_failed_to_load_keeps_its_version_on_the_tokens():
    async def go():
        gate, engine = PolicyGate(version=1), Scripted()
        llm = TrackedLLM(engine, gate, mode="abort", url="http://b")
        task = asyncio.create_task(llm.generate([0], SamplingParams(max_tokens=20), "r"))
        await wait_for(lambda: gate.streams and next(iter(gate.streams)).received >= 4, "tokens")
        gate.set(1, paused=True)
        engine.abort_now.set()
        await wait_for(lambda: not engine.abort_now.is_set(), "the abort")
        gate.set(2, paused=False, backend_versions={"http://b": 1})
        gen = await task
        assert gen.versions == [(1, 20)]
    asyncio.run(go())


def test_an_abort_nobody_announced_is_an_infrastructure_failure(monkeypatch):
    monkeypatch.setattr("rolloutd.agents.daemon.llmgate.UPDATE_NOTICE_SECONDS", 0.1)
    async def go():
        gate, engine = PolicyGate(version=1), Scripted()
        llm = TrackedLLM(engine, gate, mode="abort", url="http://b")
        engine.abort_now.set()
        with pytest.raises(BackendError):
            await llm.generate([0], SamplingParams(max_tokens=5), "r")
    asyncio.run(go())


def test_drain_mode_tags_the_whole_turn_with_one_version():
    async def go():
        llm = TrackedLLM(Scripted(), PolicyGate(version=3))
        gen = await llm.generate([0], SamplingParams(max_tokens=6), "r")
        assert gen.versions == [(3, 6)]
    asyncio.run(go())
