"""Harness gateway overhead (agents/gateway/server.py): a chat call through the gateway vs the same call
straight to the backend, side by side.

Where it sits: `python -m bench gateway` through `run(quick)`, or ``python -m bench.bench_gateway``.
The backend is the instant stub (stub_backend.py, a subprocess), so only our path is timed:
ours = client → Unix socket → gateway (chat template, tokenize, record) → VLLMBackend → stub → back;
baseline = the client's own `/v1/completions` call with the token ids straight to the stub (what a
harness pays talking to vLLM directly); and the same chat call through the relay a sandbox runs
(gateway.RELAY: TCP loopback → the socket, here a host process), which is what a harness pays. Calls
alternate one by one; each has a new user message. Target: overhead p50 ≤ 2 ms.

Streaming (`stream_rows`), per dialect (chat completions, Anthropic messages, Responses) through the gateway's
socket, alternating with the same prompt's streamed `/v1/completions` straight to the stub, which sends one token
every `TOKEN_MS`: time to the first text (the goal: the same as the direct call's, ± 2 ms) and to the end of the
stream (the per-call overhead, ≤ 2 ms).
"""
from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.bench_pipeline import REPO, _port, _wait_http

TOKEN_MS = 5.0
# the first line of a stream that carries generated text, per dialect (bytes of one SSE data line)
FIRST_TEXT = {"direct": lambda line: b'"token_ids": [' in line,
              "chat": lambda line: b'"content": "' in line and b'"content": ""' not in line,
              "messages": lambda line: b'"text_delta"' in line,
              "responses": lambda line: b'"response.output_text.delta"' in line}
MESSAGES = [{"role": "system", "content": "You are a terminal agent."},
            {"role": "user", "content": "Count the distinct words in words.txt."}]


def run(quick: bool = False) -> list[dict]:
    from rolloutd.agents.gateway.server import RELAY, Gateway
    from rolloutd.agents.llm import SamplingParams
    from rolloutd.agents.vllm_backend import VLLMBackend
    from rolloutd.agents.engine.model_dirs import prepare_model
    from rolloutd.agents.tokenizer import ChatTokenizer

    tokenizer = str(prepare_model("tiny"))
    tok = ChatTokenizer(tokenizer)
    port, relay_port = _port(), _port()
    stub = subprocess.Popen([sys.executable, "-m", "bench.stub_backend", "--port", str(port), "--tokenizer",
                             tokenizer, "--token-ms", str(TOKEN_MS)], cwd=REPO, start_new_session=True)
    n = 50 if quick else 400
    try:
        _wait_http(f"http://127.0.0.1:{port}/health")

        async def measure():
            times: dict[str, list[float]] = {"socket": [], "relay": [], "direct": []}
            async with VLLMBackend(f"http://127.0.0.1:{port}") as llm:
                gateway = Gateway(llm, tok, SamplingParams(max_tokens=16, seed=1))
                with tempfile.TemporaryDirectory() as tmp:
                    sock = Path(tmp) / "gw.sock"
                    await gateway.start(sock)
                    relay = subprocess.Popen([sys.executable, "-I", "-c", RELAY, str(sock), str(relay_port)],
                                             stdout=subprocess.PIPE, text=True)
                    try:
                        assert relay.stdout.readline().startswith("relay ready")
                        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(sock))) as gw, \
                                httpx.AsyncClient() as plain:
                            for i in range(n + 20):
                                # a new user message each call, as in a conversation: nothing is answered from a cache
                                messages = [*MESSAGES[:-1], {**MESSAGES[-1], "content": f"{MESSAGES[-1]['content']} #{i}"}]
                                ids = tok.encode_chat(messages)
                                chat = {"model": "policy", "messages": messages, "max_tokens": 16}
                                t0 = time.perf_counter()
                                r = await gw.post("http://gateway/v1/chat/completions", json=chat)
                                t1 = time.perf_counter()
                                s = await plain.post(f"http://127.0.0.1:{relay_port}/v1/chat/completions", json=chat)
                                t2 = time.perf_counter()
                                q = await plain.post(f"http://127.0.0.1:{port}/v1/completions",
                                                     json={"model": "stub", "prompt": ids, "max_tokens": 16,
                                                           "logprobs": 0, "return_token_ids": True})
                                t3 = time.perf_counter()
                                assert r.status_code == s.status_code == q.status_code == 200
                                if i >= 20:  # warm-up: connections, caches
                                    times["socket"].append(t1 - t0)
                                    times["relay"].append(t2 - t1)
                                    times["direct"].append(t3 - t2)
                    finally:
                        relay.kill()
                        relay.wait()
                        await gateway.stop()
            return times

        times = asyncio.run(measure())
        streamed = asyncio.run(measure_streams(port, tok, 30 if quick else 150))
    finally:
        stub.terminate()
        stub.wait(10)
    p50 = {k: statistics.median(v) * 1000 for k, v in times.items()}
    p95 = {k: sorted(v)[int(0.95 * (len(v) - 1))] * 1000 for k, v in times.items()}
    rows = []
    for key, what in (("socket", "the gateway's socket"), ("relay", "the in-sandbox relay + the gateway")):
        over = p50[key] - p50["direct"]
        rows += [{"benchmark": f"chat call through {what} vs straight to the backend (instant stub)",
                  "ours": f"{p50[key]:.2f} ms (p95 {p95[key]:.2f})",
                  "baseline": f"{p50['direct']:.2f} ms (p95 {p95['direct']:.2f})", "ratio": p50[key] / p50["direct"],
                  "target": "overhead p50 ≤ 2 ms", "met": over <= 2.0},
                 {"benchmark": f"overhead per call through {what} (p50 difference)", "ours": f"{over:.2f} ms",
                  "baseline": "-", "ratio": None, "target": "≤ 2 ms", "met": over <= 2.0}]
    return rows + stream_rows(streamed)


async def _timed(client: httpx.AsyncClient, url: str, body: dict, first_text) -> tuple[float, float]:
    """(seconds to the first generated text, seconds to the end of the stream) of one streamed call."""
    t0 = time.perf_counter()
    first = None
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, r.status_code
        async for line in r.aiter_lines():
            if first is None and first_text(line.encode()):
                first = time.perf_counter()
    assert first is not None, url
    return first - t0, time.perf_counter() - t0


async def measure_streams(port: int, tok, n: int) -> dict[str, list[tuple[float, float]]]:
    from rolloutd.agents.gateway.server import Gateway
    from rolloutd.agents.llm import SamplingParams
    from rolloutd.agents.vllm_backend import VLLMBackend

    times: dict[str, list[tuple[float, float]]] = {k: [] for k in FIRST_TEXT}
    async with VLLMBackend(f"http://127.0.0.1:{port}") as llm:
        gateway = Gateway(llm, tok, SamplingParams(max_tokens=16, seed=1))
        with tempfile.TemporaryDirectory() as tmp:
            sock = Path(tmp) / "gw.sock"
            await gateway.start(sock)
            try:
                async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(sock))) as gw, \
                        httpx.AsyncClient() as plain:
                    for i in range(n + 10):
                        messages = [*MESSAGES[:-1], {**MESSAGES[-1], "content": f"{MESSAGES[-1]['content']} #{i}"}]
                        calls = {
                            "direct": (plain, f"http://127.0.0.1:{port}/v1/completions",
                                       {"model": "stub", "prompt": tok.encode_chat(messages), "max_tokens": 16,
                                        "logprobs": 0, "return_token_ids": True, "stream": True}),
                            "chat": (gw, "http://gw/v1/chat/completions",
                                     {"model": "policy", "messages": messages, "max_tokens": 16, "stream": True}),
                            "messages": (gw, "http://gw/v1/messages",
                                         {"model": "policy", "system": messages[0]["content"], "messages": messages[1:],
                                          "max_tokens": 16, "stream": True}),
                            "responses": (gw, "http://gw/v1/responses",
                                          {"model": "policy", "instructions": messages[0]["content"],
                                           "input": messages[1:], "max_output_tokens": 16, "stream": True})}
                        for key, (client, url, body) in calls.items():
                            timed = await _timed(client, url, body, FIRST_TEXT[key])
                            if i >= 10:  # warm-up
                                times[key].append(timed)
            finally:
                await gateway.stop()
    return times


def stream_rows(times: dict[str, list[tuple[float, float]]]) -> list[dict]:
    first = {k: statistics.median(t[0] for t in v) * 1000 for k, v in times.items()}
    total = {k: statistics.median(t[1] for t in v) * 1000 for k, v in times.items()}
    rows = []
    for key in ("chat", "messages", "responses"):
        df, dt = first[key] - first["direct"], total[key] - total["direct"]
        rows += [{"benchmark": f"streamed {key}: time to the first text through the gateway vs straight to the "
                               f"backend (stub, a token every {TOKEN_MS:g} ms)",
                  "ours": f"{first[key]:.2f} ms", "baseline": f"{first['direct']:.2f} ms",
                  "ratio": first[key] / first["direct"], "target": "± 2 ms", "met": abs(df) <= 2.0},
                 {"benchmark": f"streamed {key}: per-call overhead (p50 difference to the stream's end)",
                  "ours": f"{dt:.2f} ms ({total[key]:.2f} vs {total['direct']:.2f})", "baseline": "-",
                  "ratio": None, "target": "≤ 2 ms", "met": dt <= 2.0}]
    return rows


if __name__ == "__main__":
    from bench.__main__ import render

    print(render(run(quick="--quick" in sys.argv)))
