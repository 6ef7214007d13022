"""How the gateway streams (agents/gateway/server.py `_stream`, agents/vllm_backend.py `VLLMBackend.stream`): the
response starts when the engine has taken the call, before its first token; the engine's chunks that one socket read
brings go on as one piece; the last piece (it carries the finish) goes out with the answer's end, in one write. Per
dialect, through the gateway's ASGI app (every write seen), and over a real HTTP connection for the backend. Why: the
per-call overhead of a streamed call (`python -m bench.bench_gateway`, bench/results/RESULTS-gateway.md). The
official SDKs reading these streams: test_gateway_dialects.py; the real engine: test_gateway_engine.py."""
from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rolloutd.agents.gateway.server import Gateway
from rolloutd.agents.llm import Generation, SamplingParams
from rolloutd.agents.vllm_backend import VLLMBackend
from rolloutd.agents.engine.model_dirs import model_dir
from rolloutd.agents.tokenizer import ChatTokenizer


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer(model_dir("tiny"))


class OneIdAPiece:
    """A streaming double: answers `text` (the tokenizer's ids), one id a piece, the last with the finish."""

    def __init__(self, tok, text):
        self.ids = tok.encode_text(text)

    async def generate(self, prompt_ids, sampling, request_id):
        return Generation(self.ids, [-0.5] * len(self.ids), "stop", list(prompt_ids), None)

    async def stream(self, prompt_ids, sampling, request_id):
        for i, t in enumerate(self.ids):
            yield Generation([t], [-0.1], "stop" if i == len(self.ids) - 1 else "", None, None)


STREAMED = {"chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
            "messages": ("/v1/messages", {"max_tokens": 32, "messages": [{"role": "user", "content": "Hi"}]}),
            "responses": ("/v1/responses", {"input": "Hi"})}


async def _asgi_stream(gw, dialect: str, send) -> None:
    """One streamed call in `dialect`, straight into the gateway's ASGI app (every write seen by `send`)."""
    path, body = STREAMED[dialect]
    request = json.dumps({"model": "m", "stream": True, **body}).encode()
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"", "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(request)).encode())]}

    async def receive():
        return {"type": "http.request", "body": request, "more_body": False}
    await gw(scope, receive, send)


@pytest.mark.parametrize("dialect", ["chat", "messages", "responses"])
def test_the_last_piece_of_a_stream_goes_out_with_its_end_in_one_write(tok, dialect):
    """Coalescing: the engine's last piece (it carries the finish) is no event of its own; its text goes out in
    the same write as the answer's end. One write per earlier piece, as it comes; the text is the answer's."""
    llm = OneIdAPiece(tok, "one two three four")
    writes: list[bytes] = []

    async def send(message):
        if message["type"] == "http.response.body":
            writes.append(message["body"])
    asyncio.run(_asgi_stream(Gateway(llm, tok, SamplingParams(max_tokens=64)), dialect, send))
    pieces = len(llm.ids)
    assert pieces >= 4 and len(writes) == pieces  # one per piece before the last, one for the last with the end
    last = tok.decode_content(llm.ids[-1:])
    assert last.strip() and last.strip() in writes[-1].decode()
    assert b"[DONE]" in writes[-1] or b"message_stop" in writes[-1] or b"response.completed" in writes[-1]


class OpensFirst(OneIdAPiece):
    """Streams as VLLMBackend does: an empty piece once the engine took the request, then the ids; notes what the
    client had been sent by then."""

    def __init__(self, tok, text):
        super().__init__(tok, text)
        self.sent: list[dict] = []
        self.before_tokens: list[dict] | None = None

    async def stream(self, prompt_ids, sampling, request_id):
        yield Generation([], [], "", None, None)
        self.before_tokens = list(self.sent)
        async for piece in super().stream(prompt_ids, sampling, request_id):
            yield piece


@pytest.mark.parametrize("dialect", ["chat", "messages", "responses"])
def test_a_stream_starts_when_the_engine_took_the_call_before_its_first_token(tok, dialect):
    """The client reads the response head (status, headers, the dialect's opening events) while the engine still
    computes the first token, so the first text costs it one event, not a response start as well."""
    llm = OpensFirst(tok, "Hello there.")

    async def send(message):
        llm.sent.append(message)
    asyncio.run(_asgi_stream(Gateway(llm, tok, SamplingParams(max_tokens=64)), dialect, send))
    assert [m["type"] for m in llm.before_tokens] == ["http.response.start", "http.response.body"]
    assert llm.before_tokens[0]["status"] == 200
    head = llm.before_tokens[1]["body"]
    opening, text_event = {"chat": (b'"role": "assistant"', b'"content": "H'), "messages": (b"message_start", b"text_delta"),
                           "responses": (b"response.created", b"output_text.delta")}[dialect]
    assert opening in head and text_event not in head  # the opening events, no text yet
    assert text_event in b"".join(m.get("body", b"") for m in llm.sent[2:])  # the text after


def test_the_engines_chunks_that_arrive_together_go_on_as_one_piece():
    """VLLMBackend.stream reads the socket, not line by line: the chunks one read brings (the reader fell behind
    the engine) are one piece, their ids and logprobs in order, exactly; over a real HTTP connection."""
    chunks = [{"choices": [{"index": 0, "text": "", "token_ids": [7 + k], "finish_reason": "stop" if k == 2 else None,
                            "logprobs": {"token_logprobs": [-0.5 * k], "tokens": [f"token_id:{7 + k}"]}}]}
              for k in range(3)]
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"

    class Engine(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - /v1/models
            self._send(json.dumps({"data": [{"id": "e", "max_model_len": 4096}]}).encode(), "application/json")

        def do_POST(self):  # noqa: N802 - the three chunks in one write
            self.rfile.read(int(self.headers["Content-Length"]))
            if self.path != "/v1/completions":  # an engine without the token endpoints (agents/vllm_tokens.py)
                self.send_error(404)
                return
            self._send(sse, "text/event-stream")

        def _send(self, data, kind):
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def go():
        async with VLLMBackend(f"http://127.0.0.1:{server.server_address[1]}") as llm:
            return [p async for p in llm.stream([1, 2, 3], SamplingParams(max_tokens=8), "r")]
    try:
        pieces = asyncio.run(go())
    finally:
        server.shutdown()
        server.server_close()
    # first an empty piece (the engine took the request: the gateway may start its response), then the three as one
    assert [(p.token_ids, p.logprobs, p.finish_reason) for p in pieces] == [([], [], ""), ([7, 8, 9], [0.0, -0.5, -1.0], "stop")]
