"""Per-token versions from the engine's weight stamps, as a unit: `weightstamps.stamped_versions` over label spans, and
`TrackedLLM` with a scripted stream that stamps its tokens as vLLM's token endpoint does (the proof against the real
engine is tests/e2e/test_async_updates.py and tests/e2e/test_shared_backend_split.py)."""
from __future__ import annotations

import asyncio

import pytest

from rolloutd.agents.daemon.llmgate import TIMED_EVERY, TrackedLLM
from rolloutd.agents.daemon.policygate import PolicyGate
from rolloutd.agents.daemon.weightstamps import joined, stamped_versions
from rolloutd.agents.llm import Generation, Preempted, SamplingParams
from rolloutd.crds.weight_labels import read_label, weight_label

UID = "uid-a"
A1, A2 = weight_label("default/a", UID, 1), weight_label("default/a", UID, 2)
B7 = weight_label("default/b", "uid-b", 7)


def test_labels_round_trip_and_the_engines_own_default_is_no_label():
    assert read_label(A1) == ("default/a", UID, 1)
    assert read_label("default") is None and read_label("{}") is None


def test_own_labels_name_their_version_wherever_they_fall():
    assert stamped_versions([(A1, 0, 5), (A2, 5, 9)], UID, start=0, now=2) == [(1, 5), (2, 4)]
    # the engine's "default" (never labelled): the version the call started with, then the job's own update
    assert stamped_versions([("default", 0, 3), (A1, 3, 8)], UID, start=None, now=1) == [(None, 3), (1, 5)]


def test_another_jobs_weights_mid_call_are_its_version_and_before_them_the_callers():
    # job a's call on a backend job b reloaded in the middle: a's own version, then b's weights, tagged b@7
    assert stamped_versions([(A1, 0, 4), (B7, 4, 10)], UID, start=1, now=1) == [(1, 4), ("default/b@7", 6)]
    # b's weights from the start: the gate's version for the backend (its mark, once the gate knows it)
    assert stamped_versions([(B7, 0, 6)], UID, start=1, now="default/b@7") == [("default/b@7", 6)]
    assert stamped_versions([(B7, 0, 6)], UID, start=1, now=1) == [(1, 6)]
    # a label of an earlier job of the same name (another uid) is not this job's
    old = weight_label("default/a", "uid-earlier", 5)
    assert stamped_versions([(old, 0, 2), (A1, 2, 4)], UID, start=None, now=1) == [(None, 2), (1, 2)]


def test_joined_stamps_cover_each_token_once_or_are_none():
    assert joined([(0, [(A1, 0, 3)]), (3, [(A2, 0, 2)])], 5) == [(A1, 0, 3), (A2, 3, 5)]
    assert joined([(0, [(A1, 0, 3)]), (3, None)], 5) is None       # a part that made tokens without stamps
    assert joined([(0, [(A1, 0, 3)]), (3, None)], 3) == [(A1, 0, 3)]  # one that made none
    assert joined([(0, [(A1, 0, 2)])], 3) is None


class Stamping:
    """Streams token 1, 2, ... as an engine that stamps them: each token gets the label `self.label` has when it is
    made; the final chunk (or an abort's) carries the spans. `hold` pauses it, `abort_now` aborts it. `generate` is
    the same as one plain request to the token endpoint: its answer (or its abort's) carries every token and the
    spans. `made`: tokens made, by either."""

    stamps = True

    def __init__(self, label: str) -> None:
        self.label = label
        self.hold = asyncio.Event()
        self.hold.set()
        self.abort_now = asyncio.Event()
        self.prompts: list[list[int]] = []
        self.made = 0

    async def generate(self, prompt_ids, sampling: SamplingParams, request_id, *, stamped: bool = False):
        assert stamped, "a plain call to an engine that stamps goes to its token endpoint"
        ids: list[int] = []
        try:
            async for piece in self.stream(prompt_ids, sampling, request_id):
                ids += piece.token_ids
                last = piece
        except Preempted as e:
            raise Preempted("aborted", Generation(ids, [-0.5] * len(ids), "abort",
                                                  weight_spans=e.partial.weight_spans)) from None
        return Generation(ids, [-0.5] * len(ids), last.finish_reason, weight_spans=last.weight_spans)

    async def stream(self, prompt_ids, sampling: SamplingParams, request_id):
        self.prompts.append(list(prompt_ids))
        labels: list[str] = []
        yield Generation([], [], "", None)
        for i in range(sampling.max_tokens):
            while not self.hold.is_set() and not self.abort_now.is_set():  # paused: only an abort ends the wait
                await asyncio.sleep(0.001)
            if self.abort_now.is_set():
                self.abort_now.clear()
                raise Preempted("aborted", Generation([], [], "abort", weight_spans=spans(labels)))
            await asyncio.sleep(0.001)
            labels.append(self.label)
            self.made += 1
            done = i == sampling.max_tokens - 1
            yield Generation([len(prompt_ids) + 1], [-0.5], "length" if done else "",
                             weight_spans=spans(labels) if done else None)

    async def abort(self, request_id):
        pass

    async def paused(self) -> bool:
        return not self.hold.is_set()


def spans(labels: list[str]) -> list[tuple[str, int, int]]:
    out: list[tuple[str, int, int]] = []
    for i, label in enumerate(labels):
        if out and out[-1][0] == label:
            out[-1] = (label, out[-1][1], i + 1)
        else:
            out.append((label, i, i + 1))
    return out


async def wait_for(pred, what: str):
    for _ in range(2000):
        if pred():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(what)


def test_keep_mode_fence_does_not_wait_for_a_stamped_stream_and_the_stamps_split_it():
    async def go():
        gate, engine = PolicyGate(version=1), Stamping(A1)
        gate.mode, gate.job_uid = "keep", UID
        llm = TrackedLLM(engine, gate, mode="keep", url="http://b")
        task = asyncio.create_task(llm.generate([0], SamplingParams(max_tokens=400), "r"))
        await wait_for(lambda: gate.streams and next(iter(gate.streams)).received >= 5, "tokens")
        gate.set(1, paused=True, fence=1)  # tokens still arrive: a stamped stream's fence is taken at once anyway
        await wait_for(lambda: gate.fence_done == 1, "the fence")
        assert not task.done()
        engine.hold.clear()  # the engine pauses (later than the fence: the stamps say where, not the fence)
        await asyncio.sleep(0.01)
        at = next(iter(gate.streams)).received
        engine.label = A2    # loaded and labelled
        gate.set(2, paused=False)
        engine.hold.set()
        gen = await task
        assert gen.versions == [(1, at), (2, 400 - at)] and 5 <= at < 400
    asyncio.run(asyncio.wait_for(go(), 20))


def test_abort_mode_stamps_each_resent_part():
    async def go():
        gate, engine = PolicyGate(version=1), Stamping(A1)
        gate.job_uid = UID
        llm = TrackedLLM(engine, gate, mode="abort", url="http://b")
        task = asyncio.create_task(llm.generate([0, 0], SamplingParams(max_tokens=30), "r"))
        await wait_for(lambda: gate.streams and next(iter(gate.streams)).received >= 8, "tokens")
        gate.set(1, paused=True)
        engine.abort_now.set()
        await wait_for(lambda: not engine.abort_now.is_set(), "the abort")
        kept = next(iter(gate.streams)).received
        engine.label = A2
        gate.set(2, paused=False)
        gen = await task
        assert gen.versions == [(1, kept), (2, 30 - kept)]
        assert gen.weight_spans == [(A1, 0, kept), (A2, kept, 30)]
    asyncio.run(go())


def test_without_the_controllers_labels_the_stamps_are_not_trusted():
    async def go():
        gate, engine = PolicyGate(version=3), Stamping("default")  # job_uid unset: an older controller
        llm = TrackedLLM(engine, gate, mode="keep", url="http://b")
        assert not llm.stamped()
        gen = await llm.generate([0], SamplingParams(max_tokens=6), "r")
        assert gen.versions == [(3, 6)]
    asyncio.run(go())


@pytest.mark.parametrize("mode, timed", [("drain", False), ("drain", True), ("keep", False)])
def test_another_jobs_abort_update_on_the_shared_backend_continues_the_call_once_the_engine_resumes(mode, timed):
    """This job's mode does not matter; in drain mode the call is one plain request to the token endpoint (or, the
    one call in TIMED_EVERY, a stream): the same tokens and versions either way."""
    async def go():
        gate, engine = PolicyGate(version=1), Stamping(A1)
        gate.job_uid = UID
        gate.drain_calls = TIMED_EVERY - 1 if timed else 0
        llm = TrackedLLM(engine, gate, mode=mode, url="http://b")
        task = asyncio.create_task(llm.generate([0, 0], SamplingParams(max_tokens=30), "r"))
        await wait_for(lambda: engine.made >= 8, "tokens")
        engine.hold.clear()      # job b pauses the engine, aborting every request on it; this job's gate stays open
        engine.abort_now.set()
        await asyncio.sleep(0.1)
        kept = engine.made
        assert len(engine.prompts) == 1 and not task.done()  # waits for the engine, not failed
        engine.label = B7        # b's weights, labelled
        engine.hold.set()        # resumed
        gen = await task
        assert gen.versions == [(1, kept), ("default/b@7", 30 - kept)]
        assert engine.prompts[1] == [0, 0] + gen.token_ids[:kept]
        assert (gen.first_token_seconds is not None) is (timed or mode == "keep")
    asyncio.run(go())


def test_an_abort_of_this_jobs_own_update_still_parks_until_the_gate_opens():
    async def go():
        gate, engine = PolicyGate(version=1), Stamping(A1)
        gate.job_uid = UID
        llm = TrackedLLM(engine, gate, mode="abort", url="http://b")
        task = asyncio.create_task(llm.generate([0], SamplingParams(max_tokens=30), "r"))
        await wait_for(lambda: gate.streams and next(iter(gate.streams)).received >= 8, "tokens")
        engine.hold.clear()
        engine.abort_now.set()
        await asyncio.sleep(0.05)
        gate.set(1, paused=True)  # the update's notice reaches the daemon while the engine is paused
        await wait_for(lambda: next(iter(gate.streams)).parked, "parked")
        engine.label = A2
        engine.hold.set()
        await asyncio.sleep(0.05)
        assert len(engine.prompts) == 1  # parked until the gate opens, not continued when the engine resumed
        gate.set(2, paused=False)
        gen = await task
        assert [v for v, _ in gen.versions] == [1, 2] and sum(n for _, n in gen.versions) == 30
    asyncio.run(go())
