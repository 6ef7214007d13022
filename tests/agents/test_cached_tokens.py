"""A backend's prefix-cache count (`usage.prompt_tokens_details.cached_tokens`) is read only where it is a count: the
answers of a real HTTP server that says it as a list, a string, a negative number or not at all give none, and the
call still succeeds, on `/v1/completions` and on the token endpoint's plain answer alike (any backend a job names may
answer anything; the count feeds the work share's arithmetic)."""
from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rolloutd.agents.llm import SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend

USAGES = [({"prompt_tokens_details": {"cached_tokens": 3}}, 3),
          ({"prompt_tokens_details": {"cached_tokens": -1}}, None),
          ({"prompt_tokens_details": {"cached_tokens": "7"}}, None),
          ({"prompt_tokens_details": {"cached_tokens": True}}, None),
          ({"prompt_tokens_details": [1]}, None), ([1, 2], None), ("x", None), (None, None)]


class _Engine(BaseHTTPRequestHandler):
    usage: object = None

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/v1/completions":
            choice = {"token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.1, -0.2]}, "finish_reason": "length"}
        else:  # the token endpoint, not streamed
            choice = {"token_ids": [5, 6], "finish_reason": "length",
                      "logprobs": {"content": [{"token_id": 5, "logprob": -0.1}, {"token_id": 6, "logprob": -0.2}]}}
        body = json.dumps({"choices": [choice], "usage": type(self).usage}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("stamped", [False, True], ids=["completions", "token-endpoint"])
@pytest.mark.parametrize("usage,cached", USAGES)
def test_only_a_count_is_read_as_the_cached_tokens(engine, usage, cached, stamped):
    _Engine.usage = usage

    async def call():
        async with VLLMBackend(engine, "m", timeout=5, connect_timeout=5) as llm:
            llm._discovered = True
            return await llm.generate([1, 2, 3], SamplingParams(max_tokens=2), "r1", stamped=stamped)

    gen = asyncio.run(call())
    assert gen.token_ids == [5, 6] and gen.cached_tokens == cached
