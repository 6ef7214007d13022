"""Tool calls per model family (agents/toolcall_formats.py), with the families' real chat templates:
Llama 3.1 and Qwen 2.5 as shipped (copied from TRL's chat_templates into tests/agents/chat_templates/), and
Mistral v0.3's tool part (chat_templates/mistral_v3.jinja, shortened, see its note). The template picks
the format; the text the template renders for an assistant's tool call is parsed back to the same call;
a malformed call is text. A real gateway on a Unix socket turns a Llama/Mistral-template model's text into
OpenAI `tool_calls` (the LLM is a double that answers those ids: the tiny random model cannot be made to
write a call)."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from rolloutd.agents.gateway.server import Gateway
from rolloutd.agents.llm import Generation, SamplingParams
from rolloutd.agents.engine.model_build import TINY_CHAT_TEMPLATE, build_tiny_tokenizer
from rolloutd.agents.wire.openai import parse_tool_calls as wire_parse
from rolloutd.agents.tokenizer import ChatTokenizer
from rolloutd.agents.toolcall_formats import format_for
from rolloutd.agents.loop.tools import parse_tool_calls

TEMPLATES = Path(__file__).parent / "chat_templates"
FAMILIES = {"llama3": "llama3_1.jinja", "mistral": "mistral_v3.jinja", "hermes": "qwen2_5.jinja"}
# where the assistant's generated text sits in each template's rendering (Mistral's ends at the eos_token,
# the tiny tokenizer's <|im_end|>)
ASSISTANT = {"llama3": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>"),
             "mistral": ("[/INST]", "<|im_end|>"), "hermes": ("<|im_start|>assistant\n", "<|im_end|>")}
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The tiny model's tokenizer, once per family's chat template."""
    base = tmp_path_factory.mktemp("tok") / "tiny"
    build_tiny_tokenizer(base)
    out = {}
    for family, name in FAMILIES.items():
        hf = AutoTokenizer.from_pretrained(base)
        hf.chat_template = (TEMPLATES / name).read_text()
        hf.save_pretrained(base.parent / family)
        out[family] = ChatTokenizer(base.parent / family)
    return out


def generated_text(tok: ChatTokenizer, family: str, call: dict) -> str:
    """What the template teaches the model to write for `call`: the assistant turn of a rendered history."""
    messages = [{"role": "user", "content": "list the files"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "id": "abcdefghi",
                                                                      "function": call}]}]
    text = tok.render(messages, tools=TOOLS)
    opening, closing = ASSISTANT[family]
    return text.rsplit(opening, 1)[1].split(closing, 1)[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_chat_template_picks_the_format(tokenizers, family):
    assert format_for(tokenizers[family]).name == family
    assert format_for(TINY_CHAT_TEMPLATE).name == "hermes" and format_for("{{ messages }}").name == "hermes"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_what_the_template_renders_for_a_call_parses_back_to_it(tokenizers, family):
    tok = tokenizers[family]
    call = {"name": "bash", "arguments": {"command": "ls -la; echo 'a \"b\"'"}}
    text = generated_text(tok, family, call)
    assert "ls -la" in text and "<tool_call>" not in text or family == "hermes"
    fmt = format_for(tok)
    [parsed] = parse_tool_calls(text, ["bash"], fmt)
    assert (parsed.name, parsed.arguments, parsed.error, parsed.format) == ("bash", call["arguments"], None, family)
    content, calls = wire_parse(text, fmt)
    assert content is None and calls[0]["function"] == {"name": "bash", "arguments": json.dumps(call["arguments"])}
    # the markers are special tokens: a content decode (skip_special_tokens) drops them, the call still parses
    for marker in ("<|python_tag|>", "[TOOL_CALLS]"):
        text = text.replace(marker, "")
    assert [c.name for c in parse_tool_calls(text, ["bash"], fmt)] == ["bash"]


CASES = {
    "llama3": {"marked": '<|python_tag|>{"name": "bash", "parameters": {"command": "ls"}}',
               "two": '{"name": "bash", "parameters": {"command": "ls"}}; {"name": "submit", "parameters": {"answer": "4"}}',
               "bad": '{"name": "bash", "parameters": {"command": "ls"}',
               "prose": 'The answer is 4. {"name": "bash"} is how I would call it.'},
    "mistral": {"marked": '[TOOL_CALLS] [{"name": "bash", "arguments": {"command": "ls"}}]',
                "two": '[TOOL_CALLS] [{"name": "bash", "arguments": {"command": "ls"}}, {"name": "submit", "arguments": {"answer": "4"}}]',
                "bad": '[TOOL_CALLS] [{"name": "bash", "arguments": {"command": "ls"}',
                "prose": "The answer is [4]."},
    "hermes": {"marked": '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>',
               "two": '<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>\n'
                      '<tool_call>{"name": "submit", "arguments": {"answer": "4"}}</tool_call>',
               "bad": '<tool_call>{"name": "bash", "arguments": {"command": "ls"}</tool_call>',
               "prose": "The answer is 4."},
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_format_reads_several_calls_and_leaves_malformed_ones_as_text(tokenizers, family):
    fmt, case = format_for(tokenizers[family]), CASES[family]
    assert [c.name for c in parse_tool_calls(case["marked"], ["bash"], fmt)] == ["bash"]
    assert [(c.name, c.arguments) for c in parse_tool_calls(case["two"], ["bash", "submit"], fmt)] == [
        ("bash", {"command": "ls"}), ("submit", {"answer": "4"})]
    assert [c["function"]["name"] for c in wire_parse(case["two"], fmt)[1]] == ["bash", "submit"]
    # malformed: the gateway answers the text as the model wrote it; the loop reports the error to the model
    assert wire_parse(case["bad"], fmt) == (case["bad"], [])
    [bad] = parse_tool_calls(case["bad"], ["bash"], fmt)
    assert bad.error and "JSON" in bad.error
    # prose is a final answer, in every family
    assert wire_parse(case["prose"], fmt) == (case["prose"], []) and parse_tool_calls(case["prose"], ["bash"], fmt) == []
    # an unknown tool is a call with an error for the loop, a call for the gateway (the harness knows its tools)
    [unknown] = parse_tool_calls(case["marked"].replace('"bash"', '"rm_rf"'), ["bash"], fmt)
    assert unknown.error and "unknown tool" in unknown.error


def test_mistral_v11_name_args_calls():
    fmt = format_for("... [TOOL_CALLS] ...")
    text = '[TOOL_CALLS]bash[ARGS]{"command": "ls"}[TOOL_CALLS]submit[ARGS]{"answer": "4"}'
    assert [(c.name, c.arguments) for c in parse_tool_calls(text, ["bash", "submit"], fmt)] == [
        ("bash", {"command": "ls"}), ("submit", {"answer": "4"})]


HOSTILE = ["", "{", "[TOOL_CALLS]", "[TOOL_CALLS] [1, 2]", "<|python_tag|>", "<|python_tag|>[]", '{"name": 5}',
           '{"name": "x", "parameters": [1]}', "[{", '[TOOL_CALLS]x[ARGS]{"a"', "<tool_call>", "<tool_call>[]",
           '{"a": 1};', '{"name": "b", "parameters": {}}; nope', "\x00" * 10, "{" * 5000]
# valid JSON that Python's parser still raises on (not a JSONDecodeError): nesting past the recursion limit, an
# integer of more than 4300 digits; in each family's call syntax, and as arguments written as a JSON string
for _value in ("[" * 100_000 + "]" * 100_000, "1" * 5000):
    HOSTILE += [f'<tool_call>{{"name": "bash", "arguments": {_value}}}</tool_call>',
                f'{{"name": "bash", "parameters": {{"a": {_value}}}}}', f'[TOOL_CALLS]bash[ARGS]{{"a": {_value}}}',
                f'[TOOL_CALLS][{{"name": "bash", "arguments": {{"a": {_value}}}}}]',
                f'<tool_call>{{"name": "bash", "arguments": {json.dumps(_value)}}}</tool_call>']


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hostile_texts_never_raise(tokenizers, family):
    fmt = format_for(tokenizers[family])
    for text in HOSTILE:
        content, calls = wire_parse(text, fmt)
        assert calls == [] or all(json.loads(c["function"]["arguments"]) is not None for c in calls)
        for call in parse_tool_calls(text, ["bash"], fmt):
            assert call.error or call.name == "bash"


class ScriptedLLM:
    """Answers each call with the ids of the next scripted text (what a Llama/Mistral model would write)."""

    def __init__(self, tok: ChatTokenizer, texts: list[str]):
        self.ids = [tok.encode_text(t) for t in texts]

    async def generate(self, prompt_ids, sampling, request_id):
        ids = self.ids.pop(0)
        return Generation(ids, [-0.5] * len(ids), "stop", list(prompt_ids), None)


@pytest.mark.parametrize("family", ["llama3", "mistral"])
def test_the_gateway_answers_a_llama_or_mistral_models_call_as_tool_calls(tokenizers, tmp_path, family):
    tok = tokenizers[family]
    texts = [CASES[family]["marked"], CASES[family]["bad"]]

    async def go():
        gateway = Gateway(ScriptedLLM(tok, texts), tok, SamplingParams(max_tokens=64))
        sock = tmp_path / "gw.sock"
        await gateway.start(sock)
        try:
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(sock)), base_url="http://gw",
                                         timeout=60) as client:
                body = {"messages": [{"role": "user", "content": "list the files"}], "tools": TOOLS}
                return [(await client.post("/v1/chat/completions", json=body)).json() for _ in texts]
        finally:
            await gateway.stop()

    good, bad = asyncio.run(go())
    choice = good["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "bash", "arguments": '{"command": "ls"}'}
    choice = bad["choices"][0]  # malformed: the text, as the real APIs answer it, never a 500
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert '"command": "ls"' in choice["message"]["content"]
