"""The gateway's dialects (agents/wire/) with the OFFICIAL SDKs as clients (`anthropic`, `openai` from PyPI): a real
gateway on a Unix socket with the real tiny tokenizer; the LLM is a scripted double whose answer is given as text
(its ids are the tokenizer's) and that streams one token at a time. Streamed and whole answers parse, tool calls
round-trip (tool_use → tool_result, function_call → function_call_output), count_tokens counts the rendered
prompt, the text is streamed before the engine has finished (the double waits for the client to have seen the
first delta), hostile bodies are 4xx in each dialect's error shape. The real engine: test_gateway_engine.py."""
from __future__ import annotations

import asyncio
import contextlib
import json

import anthropic
import httpx
import httpx2  # the SDKs' own HTTP client
import openai
import pytest

from rolloutd.agents.gateway.server import Gateway
from rolloutd.agents.llm import Generation, SamplingParams
from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.agents.tokenizer import ChatTokenizer

CALL = 'Let me look.<tool_call>{"name": "bash", "arguments": {"cmd": "ls -l"}}</tool_call>'
BASH_ANTHROPIC = {"name": "bash", "description": "Run a command", "input_schema": {
    "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
BASH_OPENAI = {"type": "function", "name": "bash", "description": "Run a command",
               "parameters": BASH_ANTHROPIC["input_schema"]}


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer(model_dir("tiny"))


class ScriptLLM:
    """Answers each call with the next text of `script` (as the tokenizer's ids), streamed one id at a time.
    With `gate`, the stream stops after its first id until `gate` is set (by the client, on its first delta)."""

    def __init__(self, tok, script, gate: asyncio.Event | None = None):
        self.tok, self.script, self.gate = tok, list(script), gate
        self.prompts: list[list[int]] = []
        self.answers: list[list[int]] = []

    def _next(self, prompt_ids):
        self.prompts.append(list(prompt_ids))
        ids = self.tok.encode_text(self.script.pop(0))
        self.answers.append(ids)
        return ids

    async def generate(self, prompt_ids, sampling, request_id):
        ids = self._next(prompt_ids)
        return Generation(ids, [-0.5] * len(ids), "stop", list(prompt_ids), None)

    async def stream(self, prompt_ids, sampling, request_id):
        ids = self._next(prompt_ids)
        for i, t in enumerate(ids):
            if i == 1 and self.gate is not None:
                await asyncio.wait_for(self.gate.wait(), 30)  # a gateway that buffers never lets the client see it
            yield Generation([t], [-0.1 * i], "stop" if i == len(ids) - 1 else "", None, None)


@contextlib.asynccontextmanager
async def gateway(tok, llm, tmp_path):
    gw = Gateway(llm, tok, SamplingParams(max_tokens=64))
    sock = tmp_path / "gw.sock"
    await gw.start(sock)
    try:
        def client(sdk=True):
            lib = httpx2 if sdk else httpx
            return lib.AsyncClient(transport=lib.AsyncHTTPTransport(uds=str(sock)), timeout=60)
        yield gw, client
    finally:
        await gw.stop()


def sdk_anthropic(client):
    return anthropic.AsyncAnthropic(base_url="http://gw", api_key="rolloutd", http_client=client(), max_retries=0)


def sdk_openai(client):
    return openai.AsyncOpenAI(base_url="http://gw/v1", api_key="rolloutd", http_client=client(), max_retries=0)


def test_anthropic_messages_whole_and_streamed_with_a_tool_round_trip(tok, tmp_path):
    async def go():
        llm = ScriptLLM(tok, [CALL, "Done: 3 files.", CALL])
        async with gateway(tok, llm, tmp_path) as (gw, client):
            sdk = sdk_anthropic(client)
            ask = [{"role": "user", "content": "List the files."}]
            first = await sdk.messages.create(model="claude-x", max_tokens=64, system="You are terse.",
                                              tools=[BASH_ANTHROPIC], messages=ask)
            use = first.content[-1]
            assert first.stop_reason == "tool_use" and first.content[0].text == "Let me look."
            assert (use.type, use.name, use.input) == ("tool_use", "bash", {"cmd": "ls -l"})
            history = ask + [{"role": "assistant", "content": [c.model_dump() for c in first.content]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                           "content": [{"type": "text", "text": "a b c"}]}]}]
            async with sdk.messages.stream(model="claude-x", max_tokens=64, tools=[BASH_ANTHROPIC],
                                           messages=history) as stream:
                texts = [t async for t in stream.text_stream]
                second = await stream.get_final_message()
            assert "".join(texts) == second.content[0].text == "Done: 3 files." and second.stop_reason == "end_turn"
            assert second.usage.output_tokens == len(llm.answers[1]) and second.usage.input_tokens == len(llm.prompts[1])
            # the tool result reached the template as the tool's message, the tool_use as the assistant's turn
            rendered = tok.decode(llm.prompts[1])
            assert "a b c" in rendered and "You may call tools" in rendered
            async with sdk.messages.stream(model="claude-x", max_tokens=64, tools=[BASH_ANTHROPIC],
                                           messages=ask) as stream:
                events = [e.type async for e in stream]
                third = await stream.get_final_message()
            assert [b.type for b in third.content] == ["text", "tool_use"] and third.content[1].input == {"cmd": "ls -l"}
            assert third.stop_reason == "tool_use" and third.content[0].text == "Let me look."
            assert events[0] == "message_start" and events[-1] == "message_stop" and "input_json" in events
            counted = await sdk.messages.count_tokens(model="claude-x", messages=ask, system="You are terse.",
                                                      tools=[BASH_ANTHROPIC])
            assert counted.input_tokens == len(llm.prompts[0])
            models = await sdk.models.list()
            assert models.data[0].id == "policy"
            assert [len(c.token_ids) for c in gw.calls] == [len(a) for a in llm.answers]
    asyncio.run(go())


def test_responses_whole_and_streamed_with_a_function_call_round_trip(tok, tmp_path):
    async def go():
        llm = ScriptLLM(tok, [CALL, "Three files.", CALL])
        async with gateway(tok, llm, tmp_path) as (gw, client):
            sdk = sdk_openai(client)
            first = await sdk.responses.create(model="gpt-x", instructions="Be terse.", input="List the files.",
                                               tools=[BASH_OPENAI])
            call = first.output[-1]
            assert first.output_text == "Let me look." and first.status == "completed"
            assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "bash", {"cmd": "ls -l"})
            items = [{"role": "user", "content": "List the files."}, *[o.model_dump() for o in first.output],
                     {"type": "function_call_output", "call_id": call.call_id, "output": "a b c"}]
            async with sdk.responses.stream(model="gpt-x", input=items, tools=[BASH_OPENAI]) as stream:
                deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
                second = await stream.get_final_response()
            assert "".join(deltas) == second.output_text == "Three files." and second.usage.output_tokens == len(llm.answers[1])
            assert "a b c" in tok.decode(llm.prompts[1])
            raw = await sdk.responses.create(model="gpt-x", input="List.", tools=[BASH_OPENAI], stream=True)
            events = [e async for e in raw]
            kinds = [e.type for e in events]
            assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
            assert [e.sequence_number for e in events] == list(range(len(events)))
            assert "response.function_call_arguments.done" in kinds and "response.output_text.done" in kinds
            final = events[-1].response
            assert [o.type for o in final.output] == ["message", "function_call"]
            assert (await sdk.models.list()).data[0].id == "policy"
    asyncio.run(go())


def test_chat_completions_streamed_with_the_tool_call_after_the_text(tok, tmp_path):
    async def go():
        llm = ScriptLLM(tok, [CALL, CALL])
        async with gateway(tok, llm, tmp_path) as (gw, client):
            sdk = sdk_openai(client)
            tools = [{"type": "function", "function": {"name": "bash", "parameters": BASH_OPENAI["parameters"]}}]
            ask = [{"role": "user", "content": "List."}]
            whole = await sdk.chat.completions.create(model="x", messages=ask, tools=tools)
            assert whole.choices[0].finish_reason == "tool_calls"
            assert whole.choices[0].message.tool_calls[0].function.name == "bash"
            chunks = [c async for c in await sdk.chat.completions.create(model="x", messages=ask, tools=tools, stream=True)]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            assert text == "Let me look." and calls[0].function.arguments == '{"cmd": "ls -l"}'
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
    asyncio.run(go())


@pytest.mark.parametrize("dialect", ["chat", "messages", "responses"])
def test_text_is_streamed_while_the_engine_still_generates(tok, tmp_path, dialect):
    """The double holds its second token until the client has read the first text delta: a gateway that sent
    the answer only once finished would never release it (the double then fails after 30 s)."""
    async def go():
        gate = asyncio.Event()
        llm = ScriptLLM(tok, ["Hello there, friend."], gate=gate)
        async with gateway(tok, llm, tmp_path) as (gw, client):
            ask = [{"role": "user", "content": "Hi"}]
            seen = []
            if dialect == "messages":
                async with sdk_anthropic(client).messages.stream(model="m", max_tokens=32, messages=ask) as s:
                    async for t in s.text_stream:
                        seen.append(t)
                        gate.set()
            elif dialect == "responses":
                async for e in await sdk_openai(client).responses.create(model="m", input="Hi", stream=True):
                    if e.type == "response.output_text.delta":
                        seen.append(e.delta)
                        gate.set()
            else:
                async for c in await sdk_openai(client).chat.completions.create(model="m", messages=ask, stream=True):
                    if c.choices and c.choices[0].delta.content:
                        seen.append(c.choices[0].delta.content)
                        gate.set()
            assert len(seen) >= 2 and "".join(seen) == tok.decode_content(gw.calls[0].token_ids)
            assert gw.calls[0].token_ids == llm.answers[0] and len(gw.calls[0].logprobs) == len(llm.answers[0])
    asyncio.run(go())


HOSTILE = {
    "/v1/messages": [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 8}, "messages"),
        ({"max_tokens": "8", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0]"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
         "messages[0].content[0].tool_use_id"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"max_tokens": 8, "system": 5, "messages": [{"role": "user", "content": "hi"}]}, "system"),
        ({"max_tokens": 8, "tools": [{"name": "x", "input_schema": 3}], "messages": [{"role": "user", "content": "hi"}]},
         "tools[0].input_schema"),
        ({"max_tokens": 8, "stop_sequences": [1], "messages": [{"role": "user", "content": "hi"}]}, "stop_sequences"),
        ({"max_tokens": 8, "stream": "yes", "messages": [{"role": "user", "content": "hi"}]}, "stream"),
    ],
    "/v1/messages/count_tokens": [({"messages": "hi"}, "messages")],
    "/v1/responses": [
        ({}, "input"),
        ({"input": 5}, "input"),
        ({"input": [{"type": "function_call", "name": "x"}]}, "input[0]"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"input": "hi", "instructions": ["x"]}, "instructions"),
        ({"input": "hi", "max_output_tokens": 0}, "max_tokens"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "tools": "bash"}, "tools"),
    ],
    "/v1/chat/completions": [({"messages": [{"role": "user", "content": "hi"}], "stop": [1, 2]}, "stop")],
}


def test_hostile_bodies_are_4xx_in_each_dialects_error_shape_and_never_reach_the_engine(tok, tmp_path):
    async def go():
        llm = ScriptLLM(tok, [])
        async with gateway(tok, llm, tmp_path) as (gw, client):
            async with client(sdk=False) as http:
                for path, cases in HOSTILE.items():
                    for body, field in cases:
                        r = await http.post(f"http://gw{path}", json=body, headers={"x-api-key": "k"})
                        assert r.status_code == 400, (path, body, r.text)
                        doc = r.json()
                        error = doc["error"]
                        assert field in error["message"], (path, body, error)
                        if path.startswith("/v1/messages"):
                            assert doc["type"] == "error" and error["type"] == "invalid_request_error"
                    r = await http.post(f"http://gw{path}", content=b"{nope")
                    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
                r = await http.post("http://gw/v1/messages", content=json.dumps(
                    {"max_tokens": 8, "messages": [{"role": "user", "content": "x" * (5 << 20)}]}).encode())
                assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
                r = await http.get("http://gw/v1/messages")
                assert r.status_code == 405 and r.json()["type"] == "error"
        assert llm.prompts == [] and gw.calls == []
    asyncio.run(go())


def test_unknown_fields_and_claude_codes_extras_are_tolerated(tok, tmp_path):
    """What Claude Code and Codex send besides the model's input (metadata, thinking, cache_control, server tools,
    reasoning items, developer messages, `?beta=true`) is accepted and ignored as the real APIs do."""
    async def go():
        llm = ScriptLLM(tok, ["ok", "ok"])
        async with gateway(tok, llm, tmp_path) as (gw, client):
            async with client(sdk=False) as http:
                r = await http.post("http://gw/v1/messages?beta=true", headers={"authorization": "Bearer x"}, json={
                    "model": "claude-sonnet", "max_tokens": 32, "metadata": {"user_id": "u"}, "temperature": 1,
                    "thinking": {"type": "disabled"}, "system": [{"type": "text", "text": "S",
                                                                   "cache_control": {"type": "ephemeral"}}],
                    "tools": [BASH_ANTHROPIC, {"type": "web_search_20250305", "name": "web_search"}],
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                               "cache_control": {"type": "ephemeral"}}]},
                                 {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                                                   {"type": "text", "text": "yes?"}]},
                                 {"role": "user", "content": "go"}]})
                assert r.status_code == 200 and r.json()["content"] == [{"type": "text", "text": "ok"}], r.text
                r = await http.post("http://gw/v1/responses", json={
                    "model": "gpt-5", "instructions": "I", "store": False, "reasoning": {"effort": "low"},
                    "include": ["reasoning.encrypted_content"], "parallel_tool_calls": False, "prompt_cache_key": "k",
                    "tools": [BASH_OPENAI, {"type": "web_search"}, {"type": "custom", "name": "apply_patch"}],
                    "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "D"}]},
                              {"type": "reasoning", "summary": [], "encrypted_content": "x"},
                              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]})
                assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "ok", r.text
        first = tok.decode(llm.prompts[0])
        assert "S" in first and "yes?" in first and "hm" not in first and "web_search" not in first
        second = tok.decode(llm.prompts[1])
        assert second.index("I\n\nD") < second.index("hi") and "apply_patch" not in second
    asyncio.run(go())


def test_a_stop_sequence_ends_the_text_before_it(tok, tmp_path):
    async def go():
        llm = ScriptLLM(tok, ["one two STOP three", "one two STOP three"])
        async with gateway(tok, llm, tmp_path) as (gw, client):
            sdk = sdk_anthropic(client)
            ask = [{"role": "user", "content": "count"}]
            whole = await sdk.messages.create(model="m", max_tokens=32, messages=ask, stop_sequences=["STOP"])
            async with sdk.messages.stream(model="m", max_tokens=32, messages=ask, stop_sequences=["STOP"]) as s:
                streamed = "".join([t async for t in s.text_stream])
                final = await s.get_final_message()
            for message in (whole, final):
                assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "STOP")
            assert whole.content[0].text == streamed == "one two "
    asyncio.run(go())


class FailingMidStream(ScriptLLM):
    async def stream(self, prompt_ids, sampling, request_id):
        from rolloutd.agents.llm import BackendError

        self.prompts.append(list(prompt_ids))
        yield Generation(self.tok.encode_text("Hi"), [-0.1], "", None, None)
        raise BackendError("connection reset")


@pytest.mark.parametrize("dialect", ["chat", "messages", "responses"])
def test_a_backend_failure_mid_stream_is_the_dialects_error_event_and_infra(tok, tmp_path, dialect):
    """The response has started (200, the first text sent) when the engine fails: the client gets the dialect's
    own error event (its SDK raises or reports it), the gateway records the failure (the rollout is infra)."""
    async def go():
        llm = FailingMidStream(tok, [])
        async with gateway(tok, llm, tmp_path) as (gw, client):
            ask = [{"role": "user", "content": "Hi"}]
            if dialect == "messages":
                with pytest.raises(anthropic.APIError, match="connection reset"):
                    async with sdk_anthropic(client).messages.stream(model="m", max_tokens=8, messages=ask) as s:
                        [t async for t in s.text_stream]
            elif dialect == "responses":
                events = [e async for e in await sdk_openai(client).responses.create(model="m", input="Hi", stream=True)]
                assert events[-1].type == "response.failed" and "connection reset" in events[-1].response.error.message
            else:
                with pytest.raises(openai.APIError, match="connection reset"):
                    [c async for c in await sdk_openai(client).chat.completions.create(model="m", messages=ask, stream=True)]
            assert "connection reset" in gw.backend_error and gw.calls == []
    asyncio.run(go())


def test_a_claude_code_sized_request_and_a_codex_sized_one_stream(tok, tmp_path):
    """The shapes issue 28 saw from the real harnesses: Claude Code's first call (~78 KB, 21 tools, system blocks
    with cache_control, `stream: true`, `?beta=true`) and Codex's (`/v1/responses`, 9 tools, `stream: true`)."""
    schema = {"type": "object", "properties": {f"p{j}": {"type": "string", "description": "d" * 300} for j in range(10)}}
    tools = [{"name": f"Tool{i}", "description": "Does a thing. " * 60, "input_schema": schema} for i in range(21)]
    body = {"model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True, "metadata": {"user_id": "u"},
            "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": "Instructions. " * 800}],
            "tools": tools, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>context</system-reminder>"},
                {"type": "text", "text": "Count the words.", "cache_control": {"type": "ephemeral"}}]}]}
    assert 70_000 < len(json.dumps(body)) < 200_000
    codex = {"model": "gpt-5-codex", "stream": True, "store": False, "instructions": "You are Codex." * 200,
             "tools": [{**BASH_OPENAI, "name": f"tool{i}"} for i in range(9)], "tool_choice": "auto",
             "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Count."}]}]}

    async def go():
        llm = ScriptLLM(tok, ["Sure.", "Sure."])
        async with gateway(tok, llm, tmp_path) as (gw, client):
            async with client(sdk=False) as http:
                r = await http.post("http://gw/v1/messages?beta=true", json=body,
                                    headers={"x-api-key": "k", "anthropic-version": "2023-06-01",
                                             "anthropic-beta": "claude-code-20250219"})
                kinds = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
                assert r.status_code == 200 and kinds[0] == "message_start" and kinds[-1] == "message_stop", r.text[:500]
                r = await http.post("http://gw/v1/responses", json=codex, headers={"authorization": "Bearer k"})
                kinds = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
                assert r.status_code == 200 and kinds[-1] == "response.completed", r.text[:500]
        assert all(f"Tool{i}" in tok.decode(llm.prompts[0]) for i in range(21))
        assert all(f"tool{i}" in tok.decode(llm.prompts[1]) for i in range(9))
    asyncio.run(go())


def test_the_deltas_of_any_ids_join_to_their_decoded_text(tok):
    """Each run of ids is decoded with a few ids of context, not the whole answer again: over random ids (broken
    UTF-8, special tokens, spaces) and multilingual text, fed one id at a time, the deltas are the full decode."""
    import random

    from rolloutd.agents.wire import TextDeltas, Turn

    rng = random.Random(1)
    samples = [[rng.randrange(tok.vocab_size) for _ in range(60)] for _ in range(50)]
    samples.append(tok.encode_text("Héllo  wörld 日本語 🚀 x\n\n  y <|im_end|> z " * 3))
    for ids in samples:
        deltas = TextDeltas(tok.decode_content, [])
        out = "".join(deltas.feed([i]) for i in ids)
        full = tok.decode_content(ids)
        assert out + deltas.rest(Turn(full, [], "stop", 0, 0)) == full
        assert len(out) >= len(full) - 8  # sent along the way, not at the end
