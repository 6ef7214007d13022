"""`TrackedLLM`'s per-token versions, as a unit: a scripted stream stands in for the engine (the proof against the real
engine is tests/e2e/test_async_updates.py). Abort mode, and keep mode on an engine that does not stamp its tokens (this
scripted one; the stamped case is test_weightstamps.py): an aborted stream's tokens are kept and the rest resubmitted
from prompt + those tokens."""
from __future__ import annotations

import asyncio

import pytest

from rolloutd.agents.daemon.llmgate import TIMED_EVERY, TrackedLLM
from rolloutd.agents.daemon.policygate import PolicyGate
from rolloutd.agents.llm import BackendError, Generation, Preempted, SamplingParams


class Scripted:
    """Streams token 1, 2, 3, ...; `hold` stops it (an engine paused), `abort_now` (or `abort`, a server-side abort,
    even while paused) ends it with an abort chunk."""

    def __init__(self) -> None:
        self.hold = asyncio.Event()
        self.hold.set()
        self.abort_now = asyncio.Event()
        self.prompts: list[list[int]] = []
        self.aborted: list[str] = []
        self.plain: list[bool] = []  # each plain call: to the token endpoint (`stamped`)?

    async def stream(self, prompt_ids, sampling: SamplingParams, request_id):
        self.prompts.append(list(prompt_ids))
        yield Generation([], [], "", None)
        for i in range(sampling.max_tokens):
            while not self.hold.is_set() and not self.abort_now.is_set():
                await asyncio.sleep(0.001)
            if self.abort_now.is_set():
                self.abort_now.clear()
                raise Preempted("aborted", Generation([], [], "abort"))
            await asyncio.sleep(0.001)
            done = i == sampling.max_tokens - 1
            yield Generation([len(prompt_ids) + 1], [-0.5], "length" if done else "")

    async def generate(self, prompt_ids, sampling, request_id, *, stamped: bool = False):  # drain mode, plain
        self.plain.append(stamped)
        return Generation([7] * sampling.max_tokens, [-0.1] * sampling.max_tokens, "length", list(prompt_ids))

    async def abort(self, request_id):
        self.aborted.append(request_id)
        self.abort_now.set()


async def wait_for(pred, what: str):
    for _ in range(2000):
        if pred():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(what)


def test_keep_mode_on_an_engine_that_does_not_stamp_aborts_at_the_fence_and_continues_exactly():
    async def go():
        gate, engine = PolicyGate(version=1), Scripted()
        gate.mode = "keep"
        llm = TrackedLLM(engine, gate, mode="keep", url="http://b")
        task = asyncio.create_task(llm.generate([0, 0], SamplingParams(max_tokens=40), "r"))
        await wait_for(lambda: gate.streams and next(iter(gate.streams)).received >= 10, "tokens")
        gate.set(1, paused=True)           # hold new calls
        engine.hold.clear()                # the engine paused with the request in place
        gate.set(1, paused=True, fence=1)  # the controller asks for the fence: where the stream stands is not provable
        await wait_for(lambda: gate.fence_done == 1, "the fence")
        assert engine.aborted == ["r"]     # so its request is aborted, its tokens so far kept
        s = next(iter(gate.streams))
        assert s.parked and s.marks == []
        kept = s.received
        gate.set(2, paused=False)          # loaded, resumed
        engine.hold.set()
        gen = await task
        assert gen.versions == [(1, kept), (2, 40 - kept)] and 10 <= kept < 40
        assert engine.prompts[1] == [0, 0] + gen.token_ids[:kept]  # resubmitted: prompt + the tokens so far
        assert len(gen.token_ids) == len(gen.logprobs) == 40
        assert llm.versions == [1]
    asyncio.run(go())


def test_a_stream_that_ended_before_the_fence_is_not_aborted():
    async def go():
        gate, engine = PolicyGate(version=1), Scripted()
        llm = TrackedLLM(engine, gate, mode="keep", url="http://b")
        gen = await llm.generate([0], SamplingParams(max_tokens=5), "r")
        gate.set(1, paused=True, fence=1)  # nothing in flight: the fence is taken at once, nothing aborted
        await wait_for(lambda: gate.fence_done == 1, "the fence")
        assert engine.aborted == [] and gen.versions == [(1, 5)]
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


@pytest.mark.parametrize("mode, stamps, streamed", [("drain", False, False), ("drain", True, False),
                                                    ("drain", None, True), ("keep", False, True),
                                                    ("abort", False, True)])
def test_a_call_streams_only_where_a_split_needs_it_and_only_a_streamed_call_has_its_time_to_first_token(
        mode, stamps, streamed):
    """Drain mode on an engine probed (stamping or not): one plain request (`generate`, ids 7; to the token endpoint,
    whose answer carries the stamps, on an engine that stamps), its time to first token not measured; streamed (ids
    1, 2, ...; the time measured) in keep and abort mode and on an engine not probed yet (None)."""
    async def go():
        engine = Scripted()
        engine.stamps = stamps
        llm = TrackedLLM(engine, PolicyGate(version=3), mode=mode, url="http://b")
        gen = await llm.generate([0], SamplingParams(max_tokens=4), "r")
        assert (engine.prompts == [[0]]) is streamed and (gen.token_ids == [7] * 4) is not streamed
        assert engine.plain == ([] if streamed else [stamps is True])
        assert (gen.first_token_seconds is not None) is streamed and gen.versions == [(3, 4)]
    asyncio.run(go())


@pytest.mark.parametrize("stamps", [True, False])
def test_one_drain_mode_call_in_timed_every_streams_to_measure_its_time_to_first_token(stamps):
    async def go():
        engine = Scripted()
        engine.stamps = stamps
        gate = PolicyGate(version=3)
        timed = []
        for turn in range(2 * TIMED_EVERY):
            gen = await TrackedLLM(engine, gate, url="http://b").generate([0], SamplingParams(max_tokens=2), f"r{turn}")
            timed.append(gen.first_token_seconds is not None)
        assert [i for i, t in enumerate(timed) if t] == [TIMED_EVERY - 1, 2 * TIMED_EVERY - 1]
        assert len(engine.prompts) == 2 and engine.plain == [stamps] * (2 * TIMED_EVERY - 2)
    asyncio.run(go())


def test_the_gateways_streamed_answer_streams_in_drain_mode_on_an_engine_that_does_not_stamp():
    async def go():
        engine, got = Scripted(), []
        engine.stamps = False

        async def on_tokens(ids):
            got.extend(ids)
        gen = await TrackedLLM(engine, PolicyGate(version=3), url="http://b").generate(
            [0], SamplingParams(max_tokens=3), "r", on_tokens)
        assert got == gen.token_ids[:2] and gen.first_token_seconds is not None
    asyncio.run(go())
