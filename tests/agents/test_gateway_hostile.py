"""The harness gateway under hostile or malformed requests (a harness is model-driven code in a sandbox): every
one is a 4xx naming what is wrong, never a 500 and never a call to the engine; bodies are bounded; a long text
is tokenized off the node daemon's event loop; a call the engine refuses is the job's configuration, not infra
and not a reward. A real gateway on a Unix socket with the real tiny tokenizer; the LLM is a recording double
(what reaches it is the assertion). The real engine behind the gateway: test_gateway.py."""
from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import httpx
import pytest

from rolloutd.agents.gateway.server import INLINE_CHARS, Gateway
from rolloutd.agents.llm import Generation, RequestRejected, SamplingParams
from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.agents.wire.openai import MAX_BODY
from rolloutd.agents.tasks.harness import _trajectory
from rolloutd.agents.tokenizer import ChatTokenizer
from rolloutd.agents.loop.rollout import RolloutContext

USER = {"role": "user", "content": "hi"}


class RecordingLLM:
    def __init__(self, reject: str | None = None):
        self.prompts: list[list[int]] = []
        self.reject = reject

    async def generate(self, prompt_ids, sampling, request_id):
        if self.reject:
            raise RequestRejected(self.reject)
        self.prompts.append(list(prompt_ids))
        return Generation([5, 6], [-0.5, -0.25], "stop", list(prompt_ids), None)


@pytest.fixture(scope="module")
def tokenizer():
    return ChatTokenizer(model_dir("tiny"))


def serve(tokenizer, tmp_path, llm, requests):
    """Start a gateway, send `requests` ((method, path, kwargs), ...), return the responses and the gateway."""
    async def go():
        gateway = Gateway(llm, tokenizer, SamplingParams(max_tokens=8))
        sock = tmp_path / "gw.sock"
        await gateway.start(sock)
        try:
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(sock)), base_url="http://gw",
                                         timeout=60) as client:
                return [await client.request(m, p, **kw) for m, p, kw in requests], gateway
        finally:
            await gateway.stop()
    return asyncio.run(go())


MALFORMED_CHAT = {
    "a message's content is an object": ({"messages": [{"role": "user", "content": {"a": 1}}]}, "messages[0].content"),
    "a message without a role": ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    "a role that is a number": ({"messages": [{"role": 5, "content": "hi"}]}, "messages[0].role"),
    "a message that is a string": ({"messages": ["hi"]}, "messages[0]"),
    "messages that are a string": ({"messages": "hi"}, "messages"),
    "no messages": ({}, "messages"),
    "a content part that is a number": ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
                                        "messages[0].content[0]"),
    "an image part": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                      "messages[0].content[0]"),
    "tools that are a string": ({"messages": [USER], "tools": "bash"}, "tools"),
    "tools that are numbers": ({"messages": [USER], "tools": [1, 2]}, "tools"),
    "max_tokens as a string": ({"messages": [USER], "max_tokens": "9"}, "max_tokens"),
    "max_tokens true": ({"messages": [USER], "max_tokens": True}, "max_tokens"),
    "max_tokens negative": ({"messages": [USER], "max_tokens": -3}, "max_tokens"),
}
MALFORMED_PROMPTS = {
    "a negative id": ([-1, 5], "token id -1"),
    "an id past the vocabulary": ([1, 10 ** 30], "token id"),
    "booleans": ([True, False], "prompt must be"),
    "nested lists": ([[1, [2]]], "prompt must be"),
    "an empty list": ([], "prompt must be"),
}


def test_malformed_requests_are_400s_naming_the_field_and_never_reach_the_engine(tokenizer, tmp_path):
    llm = RecordingLLM()
    requests = [("POST", "/v1/chat/completions", {"json": body}) for body, _ in MALFORMED_CHAT.values()]
    requests += [("POST", "/v1/completions", {"json": {"prompt": p}}) for p, _ in MALFORMED_PROMPTS.values()]
    requests += [("POST", "/v1/chat/completions", {"content": b"{not json"}),
                 ("POST", "/v1/chat/completions", {"json": [USER]}),
                 ("POST", "/v1/chat/completions", {"content": b"\xff\xfe"})]
    expected = [*(w for _, w in MALFORMED_CHAT.values()), *(w for _, w in MALFORMED_PROMPTS.values()),
                "not JSON", "JSON object", "not JSON"]
    responses, gateway = serve(tokenizer, tmp_path, llm, requests)
    for (method, path, kw), response, want in zip(requests, responses, expected):
        assert response.status_code == 400, (kw, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and want in error["message"], (kw, error)
    assert llm.prompts == [] and gateway.calls == []


def test_what_the_chat_template_refuses_is_a_400(tokenizer, tmp_path, monkeypatch):
    """Templates check conversations themselves (Llama's and Mistral's `raise_exception('Conversation roles
    must alternate ...')`): their refusal is the harness's error."""
    import jinja2

    def strict(messages, **_):
        raise jinja2.TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")
    monkeypatch.setattr(tokenizer, "render", strict)
    llm = RecordingLLM()
    responses, _ = serve(tokenizer, tmp_path, llm, [("POST", "/v1/chat/completions", {"json": {"messages": [USER]}})])
    assert responses[0].status_code == 400 and "roles must alternate" in responses[0].json()["error"]["message"]
    assert llm.prompts == []


def test_a_null_content_and_text_parts_are_accepted_as_openai_clients_send_them(tokenizer, tmp_path):
    llm = RecordingLLM()
    parts = {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}
    tool_turn = {"role": "assistant", "content": None}
    responses, gateway = serve(tokenizer, tmp_path, llm, [
        ("POST", "/v1/chat/completions", {"json": {"messages": [parts], "max_tokens": 4}}),
        ("POST", "/v1/chat/completions", {"json": {"messages": [USER, tool_turn, USER]}})])
    assert [r.status_code for r in responses] == [200, 200]
    assert llm.prompts[0] == tokenizer.encode_text(tokenizer.render([USER], add_generation_prompt=True))
    assert len(gateway.calls) == 2


def test_a_body_over_the_bound_is_refused_before_it_is_read_whole(tokenizer, tmp_path):
    llm = RecordingLLM()
    big = json.dumps({"messages": [{"role": "user", "content": "x" * MAX_BODY}]}).encode()

    async def chunked():  # no content-length: the bound is counted as the chunks come
        for i in range(0, len(big), 1 << 16):
            yield big[i:i + (1 << 16)]
    responses, gateway = serve(tokenizer, tmp_path, llm, [
        ("POST", "/v1/chat/completions", {"content": big}),
        ("POST", "/v1/chat/completions", {"content": chunked()})])
    for response in responses:
        assert response.status_code == 413 and str(MAX_BODY) in response.json()["error"]["message"]
    assert llm.prompts == []


def test_a_long_text_is_tokenized_in_a_worker_thread_to_the_same_ids(tokenizer, tmp_path, monkeypatch):
    """The fast tokenizer holds the GIL in its one-text call (seconds for megabytes): a long text goes to a
    thread through its batch call, which releases it, so the daemon's heartbeats and other rollouts go on."""
    threads = []
    encode = tokenizer.encode_text_in_thread

    def recording(text):
        threads.append(threading.get_ident())
        return encode(text)
    monkeypatch.setattr(tokenizer, "encode_text_in_thread", recording)
    long_text = "".join(f"line {i}: état ok <|im_end|>\n" for i in range(INLINE_CHARS // 20))
    llm = RecordingLLM()
    responses, _ = serve(tokenizer, tmp_path, llm, [
        ("POST", "/v1/completions", {"json": {"prompt": long_text}}),
        ("POST", "/v1/completions", {"json": {"prompt": "short"}})])
    assert [r.status_code for r in responses] == [200, 200]
    assert len(threads) == 1 and threads[0] != threading.get_ident()  # only the long one, not on the loop
    assert llm.prompts == [tokenizer.encode_text(long_text), tokenizer.encode_text("short")]


def test_a_call_the_engine_refuses_is_a_400_and_the_rollout_a_configuration_failure(tokenizer, tmp_path):
    llm = RecordingLLM(reject="HTTP 400: repetition_penalty must be positive")
    responses, gateway = serve(tokenizer, tmp_path, llm, [("POST", "/v1/chat/completions",
                                                           {"json": {"messages": [USER]}})])
    assert responses[0].status_code == 400 and "repetition_penalty" in responses[0].json()["error"]["message"]
    result = SimpleNamespace(timed_out=False, output="harness-exit=1")
    trajectory = _trajectory(gateway, tokenizer, RolloutContext(job="gw", prompt=0, sample=0), result)
    assert trajectory.failure.kind.value == "config"
    assert "spec.agent.sampling" in trajectory.failure.reason and "repetition_penalty" in trajectory.failure.reason


class SlowLLM:
    """Holds each call until released, counting how many are in the engine at once."""

    def __init__(self):
        self.now = self.most = 0

    async def generate(self, prompt_ids, sampling, request_id):
        self.now += 1
        self.most = max(self.most, self.now)
        await asyncio.sleep(0.5)  # long beside the 16 requests' arrival: the ones past the cap find it full
        self.now -= 1
        return Generation([5, 6], [-0.5, -0.25], "stop", list(prompt_ids), None)


def test_parallel_calls_of_one_rollout_reach_the_engine_one_at_a_time(tokenizer, tmp_path):
    """Issue 36: one harness sent 64 concurrent calls, 64 generations on a shared engine."""
    from rolloutd.agents.gateway.server import ENGINE_CALLS, REQUESTS_IN_FLIGHT
    llm = SlowLLM()

    async def go():
        gateway = Gateway(llm, tokenizer, SamplingParams(max_tokens=8))
        sock = tmp_path / "gw.sock"
        await gateway.start(sock)
        try:
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(sock), limits=limits),
                                         base_url="http://gw", timeout=60) as client:
                return await asyncio.gather(*(client.post("/v1/chat/completions", json={"messages": [USER]})
                                              for _ in range(16)))
        finally:
            await gateway.stop()
    codes = [r.status_code for r in asyncio.run(go())]
    assert llm.most == ENGINE_CALLS == 1
    assert set(codes) <= {200, 429} and 1 <= codes.count(200) <= REQUESTS_IN_FLIGHT, codes


def test_deep_json_nesting_is_a_400_not_a_500(tokenizer, tmp_path):
    deep = '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (r,), _ = serve(tokenizer, tmp_path, RecordingLLM(), [("POST", "/v1/chat/completions", {
        "content": deep, "headers": {"Content-Type": "application/json"}})])
    assert r.status_code == 400 and "nests too deeply" in r.text, r.text


def test_an_integer_too_long_to_read_or_call_arguments_nested_too_deeply_are_not_a_500(tokenizer, tmp_path):
    """A body holding an integer of more digits than Python converts, and a past call's arguments (a string the
    gateway parses as JSON) nested past the recursion limit: both were a 500. The first is a 400 naming it; the
    second's arguments are kept as the text they are, as any arguments that are not JSON."""
    digits = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + b"1" * 5000 + b"}"
    deep_call = {"type": "function_call", "name": "f", "call_id": "c1", "arguments": "[" * 100_000}
    llm = RecordingLLM()
    (number, nested), _ = serve(tokenizer, tmp_path, llm, [
        ("POST", "/v1/chat/completions", {"content": digits, "headers": {"Content-Type": "application/json"}}),
        ("POST", "/v1/responses", {"json": {"model": "m", "input": [
            {"role": "user", "content": "hi"}, deep_call,
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}})])
    assert number.status_code == 400 and "cannot be read" in number.json()["error"]["message"], number.text
    assert nested.status_code == 200, nested.text
    assert len(llm.prompts) == 1  # the second reached the engine, the first did not
